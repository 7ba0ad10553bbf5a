"""``daisyweb-peer``: one peer of a training group.

    daisyweb-peer --server URL [--room CODE] [--name NAME] [--approve ask|auto]
        [--start --width W --layers L --heads H --seq S --batch B --steps N --lr LR --seed X
         --capacity on|off]
        [--resume FILE.pt] [--save FILE.pt] [--save-every K] [--metrics FILE.jsonl]
        [--join-timeout SECONDS] [--stun URL ...] [--ice-host ADDR ...]
        [--turn URL --turn-user NAME --turn-credential SECRET [--relay]]
        [--transport auto|aiortc|libwebrtc] [--wait-peers N]

``--start`` makes this peer the leader; its model flags are the run's config. With
``--resume`` the checkpoint is the config: a model flag that contradicts it is refused,
and ``--steps`` sets the step budget (a finished run trains on). Without
``--start`` the model flags are refused (the leader's config wins). ``--wait-peers N``
(leader only, default 1) waits for N peers in all before step 0; later peers join at a
step boundary. ``--transport auto`` (the default) uses libwebrtc when the ``wrtc`` package
is installed (``pip install 'daisyweb[fast]'``), aiortc otherwise. The TURN credential may
also come from ``$DAISYWEB_TURN_CREDENTIAL`` (kept off the process list).

Exit codes: 0 done, 1 the run halted, 2 bad flags or files, 3 not
admitted (timeout or denied), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from daisyweb.net.ice import parse_server_url  # pure Python too

# Both pure Python, so flag errors stay instant. daisyweb.rules.DEFAULTS is the one set of
# run defaults (also daisyweb.training.config.DEFAULTS, and daisyweb-demo's).
from daisyweb.rules import (
    CODEC_NAMES,
    COMPUTE_NAMES,
    DEFAULTS,
    EXCHANGES,
    FIELD_RULES,
    OWNER_FROM,
    check_heads,
    default_overlap,
    default_sync_max,
    overlap_fits,
    parse_task_setting,
    rounds_fit,
)
from signaling.protocol import ROOM_RULE, valid_room  # the server's own room rule

TRANSPORTS = ("auto", "aiortc", "libwebrtc")  # daisyweb.net.transport.NAMES, without imports

__all__ = ["DEFAULTS", "build_parser", "parse_args", "main"]

PROG = "daisyweb-peer"
_MODEL_FLAGS = ("width", "layers", "heads", "seq", "batch", "steps", "lr", "seed",
                "sync_every", "sync_max", "outer_lr", "overlap")
_RUN_FLAGS = (*_MODEL_FLAGS, "codec", "compute", "task", "task_set")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2, never a traceback
        sys.stderr.write(f"{PROG}: error: {message}\n")
        raise SystemExit(2)


def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``; ``what`` names it in the error."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _run_flag(name: str) -> Callable[[str], int | float]:
    """An argparse type for run field ``name``: its number type and bounds are the shared
    rule (``daisyweb.rules.FIELD_RULES``), which also names it in the error."""
    rule = FIELD_RULES[name]

    def parse(text: str) -> int | float:
        try:
            value = rule.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule.what}, got {text!r}") from None
        if not rule.accepts(value):
            raise argparse.ArgumentTypeError(f"expected {rule.what}, got {text!r}")
        return value

    return parse


def task_setting(text: str) -> tuple[str, int | float]:
    """``--task-set NAME=VALUE`` as an argparse type (daisyweb-peer's and daisyweb-demo's)."""
    try:
        return parse_task_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):  # `not >` also refuses NaN
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="one peer of a daisyweb training group")
    p.add_argument("--server", required=True, help="signaling server URL (http://HOST:PORT)")
    p.add_argument("--room", default=None, help="private room code (4-64 of A-Z a-z 0-9 _ -)")
    p.add_argument("--name", default=None, help="name shown on the dashboard")
    p.add_argument("--approve", choices=("ask", "auto"), default="ask",
                   help="host only: ask on the terminal, or admit everyone with the code; "
                        "a room keeps its first host's choice when hosting passes on")
    p.add_argument("--start", action="store_true", help="lead: this peer's flags are the run")
    # Run flags stay None when not given (a --resume conflict names only given flags);
    # a --start without --resume fills them from DEFAULTS.
    for flag in _MODEL_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=_run_flag(flag),
                       help=f"leader: default {DEFAULTS[flag]}")
    p.add_argument("--codec", choices=CODEC_NAMES, default=None,
                   help=f"leader: what members exchange (default {DEFAULTS['codec']})")
    p.add_argument("--compute", choices=COMPUTE_NAMES, default=None,
                   help="leader: the forward GEMMs through the verified int8 kernels, or "
                        f"plain float32 (default {DEFAULTS['compute']})")
    p.add_argument("--task", default=None, metavar="MODULE:NAME",
                   help="leader: what the group trains, a daisyweb.tasks.Task importable "
                        "on every member with the same code (default: the built-in GPT; "
                        "e.g. daisyweb.tasks.teacher:Teacher; docs/tasks.md)")
    p.add_argument("--task-set", action="append", type=task_setting, default=None,
                   metavar="NAME=VALUE", help="leader: a setting of --task (repeatable)")
    p.add_argument("--capacity", choices=("on", "off"), default=None,
                   help="leader: give faster members a bigger share of each step's (or "
                        "round's) sequences, by their measured speed (default on); off: "
                        "equal shares")
    p.add_argument("--exchange", choices=EXCHANGES, default="auto",
                   help="how the rosters this peer names (as leader) exchange contributions: "
                        "all (every member's to every other), owner (each part of the mean "
                        f"reduced by one member), auto (owner from {OWNER_FROM} members on; "
                        "the default); members follow the leader's rosters")
    p.add_argument("--resume", default=None, metavar="FILE.pt", help="leader: resume a run")
    p.add_argument("--save", default=None, metavar="FILE.pt", help="checkpoint file (atomic)")
    p.add_argument("--eval-every", type=_non_negative_int, default=0, metavar="K",
                   help="held-out loss every K steps (at the next round boundary) in the "
                        "progress line and the metrics")
    p.add_argument("--save-every", type=_non_negative_int, default=0, metavar="K",
                   help="also save every K committed steps (needs --save)")
    p.add_argument("--metrics", default=None, metavar="FILE.jsonl")
    p.add_argument("--join-timeout", type=_positive_float, default=60.0, metavar="SECONDS")
    p.add_argument("--stun", action="append", default=[], metavar="URL")
    p.add_argument("--ice-host", action="append", default=[], metavar="ADDR",
                   help="only this host address in ICE (repeatable); 127.0.0.1 for one machine")
    p.add_argument("--turn", action="append", default=[], metavar="URL",
                   help="TURN server turn:HOST[:PORT][?transport=udp|tcp] (repeatable)")
    p.add_argument("--turn-user", default=None, metavar="NAME")
    p.add_argument("--turn-credential", default=None, metavar="SECRET",
                   help="TURN password (or $DAISYWEB_TURN_CREDENTIAL)")
    p.add_argument("--relay", action="store_true",
                   help="only relayed (TURN) candidates: traffic always goes through --turn")
    p.add_argument("--transport", choices=TRANSPORTS,
                   default=os.environ.get("DAISYWEB_TRANSPORT") or "auto",
                   help="WebRTC implementation: libwebrtc (wrtc, fast) when installed, "
                        "else aiortc (default auto, or $DAISYWEB_TRANSPORT)")
    p.add_argument("--wait-peers", type=_positive_int, default=1, metavar="N",
                   help="leader: peers in all (itself included) before step 0")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags; exits 2 with one line on anything wrong."""
    parser = build_parser()
    args = parser.parse_args(argv)
    url = urlsplit(args.server)
    if url.scheme not in ("http", "https", "ws", "wss") or not url.hostname:
        parser.error(f"--server must be an http(s):// or ws(s):// URL, got {args.server!r}")
    try:
        url.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        parser.error(f"--server has a bad port: {args.server!r}")
    if not valid_room(args.room):
        parser.error(f"--room must be {ROOM_RULE}, got {args.room[:80]!r}")
    given = [f for f in _RUN_FLAGS if getattr(args, f) is not None]
    if not args.start:
        if given:
            flag = given[0].replace("_", "-")
            parser.error(f"--{flag} needs --start (followers take the leader's config)")
        if args.resume:
            parser.error("--resume needs --start (the leader broadcasts the checkpoint)")
        if args.wait_peers != 1:
            parser.error("--wait-peers needs --start")
        if args.capacity is not None:
            parser.error("--capacity needs --start (the leader sets the shares)")
    if args.save_every and not args.save:
        parser.error("--save-every needs --save")
    if args.task_set and not args.task:
        parser.error("--task-set needs --task")
    if args.task and (args.save or args.resume):
        parser.error("--save and --resume hold the built-in GPT's checkpoints, not a "
                     "--task run's")
    check_ice_flags(parser, args)
    if args.start and not args.resume:
        for f in _MODEL_FLAGS:
            # sync_max and overlap: within the run's rounds, below
            if getattr(args, f) is None and f not in ("sync_max", "overlap"):
                setattr(args, f, DEFAULTS[f])
        if args.compute is None:
            args.compute = DEFAULTS["compute"]
        if args.sync_max is None:
            args.sync_max = default_sync_max(args.sync_every)
        elif not rounds_fit(args.sync_every, args.sync_max):
            parser.error(f"--sync-max {args.sync_max} must be at least --sync-every "
                         f"{args.sync_every} (and 1 in lockstep)")
        if args.overlap is None:
            args.overlap = default_overlap(args.sync_max)
        elif not overlap_fits(args.sync_max, args.overlap):
            parser.error(f"--overlap {args.overlap} must be at most --sync-max "
                         f"{args.sync_max} (and 0 in lockstep)")
        try:
            check_heads(args.width, args.heads)
        except ValueError:
            parser.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    return args


def check_ice_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--stun/--turn URLs, TURN credentials, --relay and --ice-host, cross-checked."""
    import ipaddress

    for url in args.stun:
        try:
            parse_server_url(url, turn=False)
        except ValueError as e:
            parser.error(f"--stun: {e}")
    for url in args.turn:
        try:
            parse_server_url(url, turn=True)
        except ValueError as e:
            parser.error(f"--turn: {e}")
    if not args.turn and (args.turn_user or args.turn_credential):
        parser.error("--turn-user/--turn-credential need --turn")
    if args.turn and args.turn_credential is None:
        args.turn_credential = os.environ.get("DAISYWEB_TURN_CREDENTIAL") or None
    if args.turn and (not args.turn_user or not args.turn_credential):
        parser.error("--turn needs --turn-user and --turn-credential "
                     "(or $DAISYWEB_TURN_CREDENTIAL)")
    if args.relay and not args.turn:
        parser.error("--relay needs --turn (relayed candidates come from a TURN server)")
    for addr in args.ice_host:
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            parser.error(f"--ice-host must be an IP address, got {addr[:80]!r}")


def _use_uvloop() -> None:
    """uvloop where it installs (not on Windows): the event loop carries every frame.
    ``DAISYWEB_EVENT_LOOP=asyncio`` keeps asyncio's own loop (to compare, or to rule
    uvloop out when something looks wrong)."""
    if os.environ.get("DAISYWEB_EVENT_LOOP") == "asyncio":
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class _CleanLines(logging.Handler):
    """The library's warnings (the mesh, the signaling client) as the peer's own lines:
    prefixed, and cleaned like them (``daisyweb.text``: they may quote a peer)."""

    def emit(self, record: logging.LogRecord) -> None:
        from daisyweb.text import clean

        try:
            sys.stderr.write(f"{PROG}: {clean(record.getMessage())}\n")
        except Exception:  # a log line must never end the run
            self.handleError(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported late so that flag errors are instant and never pay for numpy/aiortc.
    from daisyweb.peer import PeerError, options_from_args, run_peer
    from daisyweb.peer.memory import tune_malloc
    from daisyweb.text import clean

    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_CleanLines(logging.WARNING))
    tune_malloc()  # before the big arrays: freed ones go back to the system
    _use_uvloop()
    try:
        return asyncio.run(run_peer(options_from_args(args)))
    except PeerError as exc:
        sys.stderr.write(f"{PROG}: {clean(exc)}\n")
        return exc.code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
