"""The peer's entry point: checks before connecting, then one :class:`driver.Driver` run.

The pieces, one module each: ``options`` (what the user asked for), ``handshake`` (the
leader's starting state and both sides of the start handshake), ``approve`` (the host's
prompt), ``datafeed`` (batches), ``exchange`` (trainer, codec, mode), ``report`` (commit
records, saves, the end), ``items`` (the driver's queue items) and ``driver`` (the event
loop).
"""

from __future__ import annotations

from pathlib import Path

from daisyweb.peer.driver import Driver, MeshFactory
from daisyweb.peer.handshake import leader_state, tokenizer_info
from daisyweb.peer.options import PeerError, PeerOptions, log

__all__ = ["resolve_transport", "run_peer"]


def resolve_transport(name: str) -> str:
    """The transport ``--transport name`` means here ("auto" resolved), said in the
    peer's first line; PeerError(2) when the one asked for cannot load."""
    from daisyweb.net.transport import TransportError, choose

    try:
        transport = choose(name)
    except TransportError as exc:
        raise PeerError(2, str(exc)) from None
    why = " (auto: wrtc is installed)" if name == "auto" and transport.name == "libwebrtc" \
        else " (auto: wrtc is not installed)" if name == "auto" else ""
    log(f"transport: {transport.name}{why}")
    return transport.name


async def run_peer(
    opts: PeerOptions,
    *,
    mesh_factory: MeshFactory | None = None,
    driver_class: type[Driver] | None = None,
) -> int:
    """Run one peer to the end. Returns the exit code; raises PeerError for setup errors.

    ``mesh_factory`` (default ``daisyweb.net.Mesh``) lets tests run several peers in
    one process over an in-memory mesh with the same interface; ``driver_class``
    (default :class:`Driver`) lets them wrap its parts.
    """
    if opts.save:
        parent = Path(opts.save).resolve().parent
        if parent.exists() and not parent.is_dir():
            raise PeerError(2, f"--save: {parent} is not a directory")
        if not parent.is_dir():
            raise PeerError(2, f"--save: directory {parent} does not exist")
    tok, tokinfo = tokenizer_info()
    state = leader_state(opts, tokinfo) if opts.start else None
    try:
        driver = (driver_class or Driver)(opts, tok, tokinfo, state, mesh_factory)
    except OSError as exc:  # the only file the driver opens up front is --metrics
        raise PeerError(2, f"--metrics: cannot open {opts.metrics}: "
                           f"{exc.strerror or exc}") from None
    if mesh_factory is None:  # after the file checks: a bad file stays one line
        opts.transport = resolve_transport(opts.transport)
    return await driver.main()
