"""Command line entry point: ``daisyweb-signal``."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from urllib.parse import urlsplit

from aiohttp import web

from .server import MAX_PER_ADDRESS, create_app


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, non-zero exit
        sys.stderr.write(f"daisyweb-signal: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="daisyweb-signal", description="daisyweb signaling server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8787)
    p.add_argument(
        "--data", choices=("fineweb", "builtin"), default="fineweb",
        help="/data source: FineWeb-Edu (falls back to the built-in corpus) or built-in only",
    )
    p.add_argument(
        "--hf-endpoint", default=None, metavar="URL",
        help="Hugging Face endpoint or mirror for FineWeb-Edu (default $HF_ENDPOINT, else the Hub)",
    )
    p.add_argument("--trust-proxy", action="store_true", help="honour X-Forwarded-For")
    p.add_argument("--heartbeat", type=float, default=20.0)
    p.add_argument(
        "--max-per-address", type=int, default=MAX_PER_ADDRESS, metavar="N",
        help="open WebSocket connections allowed per client address; more are closed "
             f"with a reason (default {MAX_PER_ADDRESS})",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked flags; a bad one exits 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be 1-65535, got {args.port}")
    if args.heartbeat <= 0:
        parser.error("--heartbeat must be positive")
    if args.max_per_address < 1:
        parser.error(f"--max-per-address must be at least 1, got {args.max_per_address}")
    if args.hf_endpoint is not None:
        u = urlsplit(args.hf_endpoint)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            parser.error(f"--hf-endpoint must be an http(s) URL, got {args.hf_endpoint!r}")
    return args


def build_app(args: argparse.Namespace) -> web.Application:
    return create_app(
        trust_proxy=args.trust_proxy,
        heartbeat=args.heartbeat,
        data_source=args.data,
        hf_endpoint=args.hf_endpoint,
        max_per_address=args.max_per_address,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        web.run_app(build_app(args), host=args.host, port=args.port)
    except OSError as exc:
        # Binding is the only OSError run_app lets out; say which port and what to do.
        if exc.errno == errno.EADDRINUSE:
            why = "is in use; pick another with --port"
        else:
            why = f"cannot be opened: {exc.strerror or exc}"
        sys.stderr.write(f"daisyweb-signal: port {args.port} on {args.host} {why}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
