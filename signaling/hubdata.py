"""Which dataset ``/data`` serves and where its parquet shards are, as the Hub lists them.

``daisyweb-signal --dataset REPO [--config NAME] [--split NAME] [--text-column COL]``
names a :class:`DatasetSpec`; :func:`list_shards` asks the Hub (or a mirror at
``--hf-endpoint``) through ``huggingface_hub`` for the repo's files and its card's
``configs`` (the same ``configs:`` block of the README's YAML that the ``datasets``
library reads), and returns the parquet files of the chosen config and split, pinned to
the commit it listed. What the Hub answers "no" to (no such repo, config or split, no
parquet files) is a :class:`DatasetMissing`; anything else (no network, a 5xx) is a
:class:`DatasetUnreachable`, which the reader retries later.

The default is FineWeb-Edu's ``sample-10BT`` config (14 parquet shards of ~2 GB). No
token is ever sent: gated and private datasets are refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_DATASET",
    "DatasetMissing",
    "DatasetSpec",
    "DatasetUnreachable",
    "Listing",
    "check_name",
    "glob_match",
    "list_shards",
    "quoted",
    "safe_file_name",
]

log = logging.getLogger("daisyweb.signal")

FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
MAX_NAME_CHARS = 200  # config, split and column names on the command line
_NAME_LIST = 12  # names quoted in a refusal, at most
# The split keywords the ``datasets`` library recognizes in file names, for repos whose
# card declares no configs.
_SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}


class DatasetMissing(Exception):
    """The Hub says the dataset, config, split or text column is not there (a refusal)."""


class DatasetUnreachable(Exception):
    """The Hub (or mirror) did not answer usefully; worth retrying later."""


@dataclass(frozen=True)
class DatasetSpec:
    """What ``/data`` serves: a dataset repo, one config and split, one text column."""

    repo: str = FINEWEB_EDU
    config: str | None = None  # None: the card's default config
    split: str = "train"
    text_column: str = "text"

    def describe(self) -> dict[str, str | None]:
        return {"dataset": self.repo, "config": self.config, "split": self.split,
                "text_column": self.text_column}

    def label(self) -> str:
        """One line for logs: ``repo (config, split, column text)``."""
        config = self.config or "default config"
        return f"{self.repo} ({config}, split {self.split}, column {self.text_column})"


# FineWeb-Edu's full default config is 1.3 T tokens in thousands of shards; its 10 B-token
# sample (14 shards) is far more text than a run trains on.
DEFAULT_DATASET = DatasetSpec(FINEWEB_EDU, "sample-10BT")


@dataclass(frozen=True)
class Listing:
    """The shards of one config and split, at the commit the Hub listed."""

    spec: DatasetSpec  # with the config that was chosen filled in
    revision: str
    files: tuple[str, ...]


def quoted(text: object, limit: int = 80) -> str:
    """``repr`` of a name that came from the Hub or a mirror, bounded for one log line."""
    s = repr(str(text))
    return s if len(s) <= limit else s[:limit - 4] + "...'"


def _names(items: Iterable[object]) -> str:
    got = [quoted(x, 60) for x in items]
    more = len(got) - _NAME_LIST
    return ", ".join(got[:_NAME_LIST]) + (f" and {more} more" if more > 0 else "") or "none"


def check_name(text: str, what: str) -> str:
    """A config, split or column name from the command line: printable, 1..200 chars."""
    if not 1 <= len(text) <= MAX_NAME_CHARS or not text.isprintable() or text != text.strip():
        raise ValueError(f"{what} must be 1-{MAX_NAME_CHARS} printable characters without "
                         f"surrounding spaces, got {quoted(text)}")
    return text


def glob_match(pattern: str, path: str) -> bool:
    """``fsspec``-style glob as a dataset card uses it: ``*`` and ``?`` stay within one
    path segment, ``**`` crosses segments."""
    pattern = pattern.removeprefix("./")
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.fullmatch("".join(out), path) is not None


def safe_file_name(name: str) -> bool:
    """True for a listed file name that can only name a file inside its repo: relative,
    no empty, ``.`` or ``..`` segment, no backslash or control character. A resolve URL
    built from ``../../x`` or ``//host/x`` is normalized to another path of the endpoint
    (``/datasets/x``) or another host."""
    if not name or not name.isprintable() or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _patterns(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise DatasetMissing(f"the dataset card's data_files has a path of a form this reader "
                         f"does not know: {quoted(value)}")


def _split_patterns(data_files: Any) -> dict[str, list[str]]:
    """A config's ``data_files`` (a path, a list of paths, a list of {split, path}, or a
    {split: path} mapping) as split -> patterns."""
    if isinstance(data_files, str) or (
            isinstance(data_files, list) and all(isinstance(v, str) for v in data_files)):
        return {"train": _patterns(data_files)}
    if isinstance(data_files, list):
        out: dict[str, list[str]] = {}
        for entry in data_files:
            if not isinstance(entry, dict) or not isinstance(entry.get("split"), str):
                raise DatasetMissing("the dataset card has a data_files entry without a "
                                     "split")
            out.setdefault(entry["split"], []).extend(_patterns(entry.get("path")))
        return out
    if isinstance(data_files, dict):
        return {str(k): _patterns(v) for k, v in data_files.items()}
    raise DatasetMissing(f"the dataset card's data_files is of a form this reader does not "
                         f"know: {quoted(data_files)}")


def _choose_config(spec: DatasetSpec, configs: Sequence[Any]) -> tuple[str, Any]:
    """(config name, its data_files) from the card's ``configs`` list."""
    named = [c for c in configs if isinstance(c, dict) and isinstance(c.get("config_name"), str)]
    names = [c["config_name"] for c in named]
    if spec.config is not None:
        for c in named:
            if c["config_name"] == spec.config:
                return spec.config, c.get("data_files")
        raise DatasetMissing(f"dataset {spec.repo} has no config {quoted(spec.config)} "
                             f"(its configs: {_names(names)})")
    default = ([c for c in named if c.get("default") is True]
               or [c for c in named if c["config_name"] == "default"]
               or (named if len(named) == 1 else []))
    if not default:
        raise DatasetMissing(f"dataset {spec.repo} has several configs and none is the "
                             f"default; pass --config (its configs: {_names(names)})")
    return default[0]["config_name"], default[0].get("data_files")


def _inferred_split(path: str) -> str | None:
    """The split a file name says it belongs to (``datasets``' keywords), if any."""
    words = set(re.split(r"[-._ /0-9]+", path.lower()))
    for split, keys in _SPLIT_WORDS.items():
        if words & set(keys):
            return split
    return None


def select_files(spec: DatasetSpec, files: Sequence[str],
                 card: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    """(config name, sorted parquet files of ``spec``'s config and split) of a repo.

    A name that could point outside the repo (:func:`safe_file_name`) is left out, with
    one warning naming them."""
    unsafe = [f for f in files if not safe_file_name(f)]
    if unsafe:
        log.warning("dataset %s lists %d file names that point outside it, ignored: %s",
                    spec.repo, len(unsafe), _names(unsafe))
    parquet = sorted(f for f in files if f.endswith(".parquet") and safe_file_name(f))
    configs = (card or {}).get("configs")
    if isinstance(configs, list) and configs:
        config, data_files = _choose_config(spec, configs)
        by_split = _split_patterns(data_files if data_files is not None else "**")
        if spec.split not in by_split:
            raise DatasetMissing(f"config {quoted(config)} of dataset {spec.repo} has no "
                                 f"split {quoted(spec.split)} (its splits: "
                                 f"{_names(by_split)})")
        pats = by_split[spec.split]
        chosen = [f for f in parquet if any(glob_match(p, f) for p in pats)]
    else:
        if spec.config not in (None, "default"):
            raise DatasetMissing(f"dataset {spec.repo} declares no configs, so it has no "
                                 f"config {quoted(spec.config)}; leave --config out")
        config = "default"
        splits = {f: _inferred_split(f) for f in parquet}
        if any(s is not None for s in splits.values()):
            chosen = [f for f, s in splits.items() if s == spec.split]
            if not chosen:
                found = sorted({s for s in splits.values() if s is not None})
                raise DatasetMissing(f"dataset {spec.repo} has no split "
                                     f"{quoted(spec.split)} (its splits: {_names(found)})")
        elif spec.split == "train":
            chosen = parquet  # no split named anywhere: everything is train
        else:
            raise DatasetMissing(f"dataset {spec.repo} has no split {quoted(spec.split)} "
                                 "(its files name no split, so all of it is 'train')")
    if not chosen:
        raise DatasetMissing(f"config {quoted(config)} split {quoted(spec.split)} of dataset "
                             f"{spec.repo} has no parquet files (/data reads parquet only)")
    return config, chosen


def list_shards(spec: DatasetSpec, endpoint: str, timeout: float = 20.0) -> Listing:
    """The parquet shards of ``spec`` as the Hub at ``endpoint`` lists them (blocking).

    Raises :class:`DatasetMissing` when the Hub says the repo, config or split is not
    there, :class:`DatasetUnreachable` when it cannot be asked.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    api = HfApi(endpoint=endpoint, token=False)  # never a token: public datasets only
    try:
        info = api.dataset_info(spec.repo, expand=["cardData", "siblings", "sha"],
                                timeout=timeout, token=False)
    except GatedRepoError:
        raise DatasetMissing(f"dataset {spec.repo} is gated (it needs an access token, "
                             "which daisyweb-signal does not send)") from None
    except (RepositoryNotFoundError, DisabledRepoError):
        raise DatasetMissing(f"no dataset {spec.repo} at {endpoint} (or it is "
                             "private)") from None
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status == 404:
            raise DatasetMissing(f"no dataset {spec.repo} at {endpoint}") from None
        raise DatasetUnreachable(f"{endpoint} answered {status} for {spec.repo}") from None
    except Exception as exc:  # noqa: BLE001 - no network, a bad answer: all "try later"
        raise DatasetUnreachable(f"cannot list {spec.repo} at {endpoint}: "
                                 f"{type(exc).__name__}: {str(exc)[:200]}") from None
    files = [s.rfilename for s in (info.siblings or []) if isinstance(s.rfilename, str)]
    card = info.card_data.to_dict() if info.card_data is not None else {}
    config, chosen = select_files(spec, files, card)
    sha = info.sha if isinstance(info.sha, str) and re.fullmatch(r"[0-9a-f]{40}", info.sha) \
        else "main"
    return Listing(DatasetSpec(spec.repo, config, spec.split, spec.text_column), sha,
                   tuple(chosen))
