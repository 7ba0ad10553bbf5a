"""ICE settings shared by every transport: which addresses, which servers, what is signaled.

Pure Python (no WebRTC library is imported here), so each transport module
(``transport_aiortc``, ``transport_libwebrtc``) turns the same :class:`IceSettings` into
its own configuration.

* ``--ice-host ADDR`` (or ``$DAISYWEB_ICE_HOSTS``) names the host addresses a peer may
  use. aiortc gathers only those (``transport_aiortc`` replaces aioice's address
  discovery); libwebrtc gathers every interface and offers no way to name them, so for it
  the list is enforced on what is signaled: :func:`filter_candidates` drops every
  candidate line of a session description that is not on the list, in what this peer
  sends and in what it takes from others (so it never probes another address either).
* mDNS candidates (``*.local``) are always dropped: a peer never announces or resolves
  them.
* ``--stun URL`` and ``--turn URL`` (with a username and credential) are ICE servers;
  none by default, so nothing outside the group is contacted. ``relay_only`` is the
  ``iceTransportPolicy relay`` of the W3C API: only TURN-relayed candidates.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "IceServer",
    "IceSettings",
    "filter_candidates",
    "hosts_from_env",
    "non_loopback_interfaces",
    "normalize_hosts",
    "parse_server_url",
    "sdp_candidates",
]

ENV_VAR = "DAISYWEB_ICE_HOSTS"

# RFC 7064 / 7065: scheme ":" host [":" port] ["?transport=" udp|tcp]
_SERVER_URL = re.compile(
    r"(?P<scheme>stuns?|turns?):(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+)"
    r"(?::(?P<port>[0-9]{1,5}))?(?:\?transport=(?P<transport>udp|tcp))?"
)


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server; TURN needs a username and a credential."""

    url: str
    username: str | None = None
    credential: str | None = None

    @property
    def is_turn(self) -> bool:
        return self.url.startswith("turn")


@dataclass(frozen=True)
class IceSettings:
    """What a peer connection may gather and signal, for any transport."""

    hosts: tuple[str, ...] | None = None  # None: any address (no --ice-host)
    servers: tuple[IceServer, ...] = ()
    relay_only: bool = False

    @property
    def loopback(self) -> bool:
        """Whether a named host address is a loopback one (libwebrtc skips those)."""
        return any(ipaddress.ip_address(h).is_loopback for h in self.hosts or ())


def parse_server_url(url: str, *, turn: bool) -> str:
    """``url`` if it is a valid STUN (``turn=False``) or TURN URL; else ValueError."""
    m = _SERVER_URL.fullmatch(url)
    want = ("turn", "turns") if turn else ("stun", "stuns")
    if m is None or m["scheme"] not in want:
        kind = "turn:HOST[:PORT][?transport=udp|tcp]" if turn else "stun:HOST[:PORT]"
        raise ValueError(f"expected a URL like {kind}, got {url[:80]!r}")
    if m["port"] is not None and not 0 < int(m["port"]) < 65536:
        raise ValueError(f"bad port in {url[:80]!r}")
    if not turn and m["transport"] is not None:
        raise ValueError(f"a STUN URL takes no transport: {url[:80]!r}")
    return url


def hosts_from_env() -> list[str] | None:
    """Comma-separated addresses from ``DAISYWEB_ICE_HOSTS``, or None if unset/empty."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    return [a.strip() for a in raw.split(",") if a.strip()]


def normalize_hosts(addresses: Iterable[str] | None) -> tuple[str, ...] | None:
    """Canonical addresses (ValueError on a bad one); None or empty stays None."""
    addrs = list(addresses) if addresses is not None else []
    if not addrs:
        return None
    return tuple(str(ipaddress.ip_address(a)) for a in addrs)


def _ip(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _keep(line: str, hosts: Sequence[str] | None) -> bool:
    """Whether one ``a=candidate:`` line may be signaled (see the module docstring)."""
    parts = line.split()
    # foundation component transport priority address port "typ" type [raddr A rport P]...
    if len(parts) < 8 or parts[6] != "typ":
        return False
    address = _ip(parts[4])
    if address is None:  # an mDNS name (or garbage): never announced nor resolved
        return False
    if hosts is None:
        return True
    kind = parts[7]
    if kind == "host":
        return address in hosts
    if kind == "relay":  # the TURN server's address, relayed through it
        return True
    # srflx/prflx: their base (raddr) must be an allowed interface
    extra = dict(zip(parts[8::2], parts[9::2], strict=False))
    return _ip(extra.get("raddr", "")) in hosts


def filter_candidates(sdp: str, hosts: Sequence[str] | None) -> str:
    """``sdp`` without the candidate lines a peer restricted to ``hosts`` must not use."""
    lines = sdp.split("\r\n") if "\r\n" in sdp else sdp.split("\n")
    sep = "\r\n" if "\r\n" in sdp else "\n"
    kept = [ln for ln in lines if not ln.startswith("a=candidate:") or _keep(ln, hosts)]
    return sep.join(kept)


def sdp_candidates(sdp: str) -> list[tuple[str, str]]:
    """(address, type) of every candidate line in ``sdp``, for tests and logs."""
    out = []
    for ln in sdp.splitlines():
        if ln.startswith("a=candidate:"):
            parts = ln.split()
            if len(parts) >= 8:
                out.append((parts[4], parts[7]))
    return out


def non_loopback_interfaces(net_dev: Path = Path("/proc/self/net/dev")) -> list[str]:
    """Network interfaces of this process's network namespace other than ``lo``, sorted.

    ``/proc/self/net/dev`` follows the namespace (``/sys/class/net`` shows the one sysfs
    was mounted in)."""
    names = [ln.split(":", 1)[0].strip() for ln in net_dev.read_text().splitlines()[2:]]
    return sorted(n for n in names if n and n != "lo")
