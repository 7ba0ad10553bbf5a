"""Command line entry point: ``daisyweb-signal``."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from urllib.parse import urlsplit

from aiohttp import web

from .guard import MAX_CONNECTIONS_PER_ADDRESS, connection_limit, run_app
from .hubdata import DEFAULT_DATASET, DatasetSpec, check_name
from .server import MAX_PER_ADDRESS, create_app

log = logging.getLogger("daisyweb.signal")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, non-zero exit
        sys.stderr.write(f"daisyweb-signal: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="daisyweb-signal", description="daisyweb signaling server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8787)
    p.add_argument(
        "--data", choices=("hub", "fineweb", "builtin"), default="hub",
        help="/data source: a Hub dataset (--dataset; falls back to the built-in corpus) "
             "or built-in only ('fineweb' is the old name of 'hub')",
    )
    p.add_argument(
        "--dataset", default=None, metavar="REPO",
        help=f"parquet dataset on the Hub for /data (default {DEFAULT_DATASET.repo}, "
             f"config {DEFAULT_DATASET.config})",
    )
    p.add_argument("--config", default=None, metavar="NAME",
                   help="the dataset's config (default: the one its card marks default)")
    p.add_argument("--split", default=None, metavar="NAME", help="split (default train)")
    p.add_argument("--text-column", default=None, metavar="COL",
                   help="the column holding the text (default text)")
    p.add_argument(
        "--hf-endpoint", default=None, metavar="URL",
        help="Hugging Face endpoint or mirror for the dataset (default $HF_ENDPOINT, "
             "else the Hub)",
    )
    p.add_argument("--trust-proxy", action="store_true", help="honour X-Forwarded-For")
    p.add_argument("--heartbeat", type=float, default=20.0)
    p.add_argument(
        "--max-per-address", type=int, default=MAX_PER_ADDRESS, metavar="N",
        help="open WebSocket connections allowed per client address; more are closed "
             f"with a reason (default {MAX_PER_ADDRESS})",
    )
    p.add_argument(
        "--max-connections", type=int, default=None, metavar="N",
        help="TCP connections of any kind the server holds at once; more are answered 503 "
             f"and closed (default 3/4 of the descriptor limit: {connection_limit()} here)",
    )
    p.add_argument(
        "--max-connections-per-address", type=int, default=MAX_CONNECTIONS_PER_ADDRESS,
        metavar="N", help="TCP connections of any kind one client address may hold "
                          f"(default {MAX_CONNECTIONS_PER_ADDRESS}; all of them come from "
                          "the proxy with --trust-proxy, so none is applied then)",
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
    if args.max_connections is not None and args.max_connections < 1:
        parser.error(f"--max-connections must be at least 1, got {args.max_connections}")
    if args.max_connections_per_address < 1:
        parser.error("--max-connections-per-address must be at least 1, got "
                     f"{args.max_connections_per_address}")
    if args.hf_endpoint is not None:
        u = urlsplit(args.hf_endpoint)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            parser.error(f"--hf-endpoint must be an http(s) URL, got {args.hf_endpoint!r}")
    picked = [f for f in ("dataset", "config", "split", "text_column")
              if getattr(args, f) is not None]
    if args.data == "builtin" and picked:
        parser.error(f"--{picked[0].replace('_', '-')} needs a Hub dataset, not --data builtin")
    try:
        args.dataset_spec = dataset_spec(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """The dataset the flags name; FineWeb-Edu's sample-10BT when none is named."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo = args.dataset or DEFAULT_DATASET.repo
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise ValueError(f"--dataset must be a Hub repo id (owner/name), got "
                         f"{repo[:80]!r}") from None
    config = args.config
    if config is None and args.dataset is None:
        config = DEFAULT_DATASET.config
    for flag, value in (("--config", config), ("--split", args.split),
                        ("--text-column", args.text_column)):
        if value is not None:
            check_name(value, flag)
    return DatasetSpec(repo, config, args.split or DEFAULT_DATASET.split,
                       args.text_column or DEFAULT_DATASET.text_column)


def build_app(args: argparse.Namespace, reader: object = None) -> web.Application:
    return create_app(
        trust_proxy=args.trust_proxy,
        heartbeat=args.heartbeat,
        data_source=args.data,
        hf_endpoint=args.hf_endpoint,
        dataset=args.dataset_spec,
        fineweb=reader,
        max_per_address=args.max_per_address,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
    )


def prepared_reader(args: argparse.Namespace) -> object:
    """The dataset reader, its shards listed and its text column checked (blocking).

    Raises ``DatasetMissing`` (a refusal: no such repo, config, split or column). When
    the Hub cannot be asked (offline, down) it logs so and returns the reader unprepared:
    the server starts, serves the built-in corpus and /data retries the listing.
    """
    from .fineweb import FineWebReader, hub_offline
    from .hubdata import DatasetUnreachable

    reader = FineWebReader(args.hf_endpoint, dataset=args.dataset_spec)
    if hub_offline():
        log.warning("HF_HUB_OFFLINE is set: %s not checked; /data serves the built-in "
                    "corpus", args.dataset_spec.label())
        return reader
    try:
        reader.prepare()
    except DatasetUnreachable as exc:
        log.warning("%s not checked at start (%s); /data serves the built-in corpus until "
                    "it answers", args.dataset_spec.label(), exc)
        return reader
    log.info("/data serves %s: %d parquet shards", reader.dataset.label(), len(reader.shards))
    return reader


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    reader = None
    if args.data != "builtin":
        from .hubdata import DatasetMissing

        try:
            reader = prepared_reader(args)
        except DatasetMissing as exc:
            sys.stderr.write(f"daisyweb-signal: --dataset: {exc}\n")
            return 2
    try:
        run_app(build_app(args, reader), host=args.host, port=args.port)
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
