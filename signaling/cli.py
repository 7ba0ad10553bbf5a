"""Command line entry point: ``daisyweb-signal``."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from .server import create_app


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, non-zero exit
        sys.stderr.write(f"daisyweb-signal: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="daisyweb-signal", description="daisyweb signaling server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8787)
    p.add_argument("--data", choices=("fineweb", "builtin"), default="fineweb")
    p.add_argument("--hf-endpoint", default=None, help="Hugging Face endpoint URL")
    p.add_argument("--trust-proxy", action="store_true", help="honour X-Forwarded-For")
    p.add_argument("--heartbeat", type=float, default=20.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.port < 65536:
        build_parser().error(f"--port must be 1-65535, got {args.port}")
    if args.heartbeat <= 0:
        build_parser().error("--heartbeat must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(
        trust_proxy=args.trust_proxy,
        heartbeat=args.heartbeat,
        data_source=args.data,
        hf_endpoint=args.hf_endpoint,
    )
    web.run_app(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
