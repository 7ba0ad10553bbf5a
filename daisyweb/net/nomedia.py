"""Load aiortc (or libwebrtc's ``webrtc.aiortc``) without PyAV: data channels only.

Both packages import PyAV (``av``: FFmpeg's codecs) at import time for their audio and
video tracks, which a peer that only opens data channels never uses. PyAV and the FFmpeg
libraries it maps cost a peer about 17 MB of resident memory (``docs/limits.md``,
section 1). :func:`install` puts a stand-in for ``av`` and every ``av.*`` submodule in
front of the real one: any name imported from it is a class that refuses to be created,
so a media call that should never happen fails with one clear line instead of running.

Installed by ``transport.choose`` before it imports a transport, and only when ``av`` is
not loaded yet (a process that already uses PyAV keeps it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["MediaUnavailable", "install", "installed"]

_PACKAGE = "av"


class MediaUnavailable(RuntimeError):
    """A media object (PyAV) was used in a peer that loads data channels only."""


def _absent(qualname: str) -> type:
    """A class named ``qualname`` that cannot be instantiated."""

    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise MediaUnavailable(
            f"{qualname} is not available: daisyweb loads WebRTC for data channels only, "
            "without PyAV (daisyweb.net.nomedia)")

    module, _, name = qualname.rpartition(".")
    return type(name, (), {"__new__": refuse, "__qualname__": qualname, "__module__": module})


class _StandIn(types.ModuleType):
    """``av`` or one of its submodules: every attribute is an :func:`_absent` class."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)  # keep the import machinery's probes honest
        value = _absent(f"{self.__name__}.{attr}")
        setattr(self, attr, value)  # the same class each time it is imported
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``av`` and ``av.*`` as stand-ins, ahead of every other finder."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _PACKAGE and not fullname.startswith(_PACKAGE + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []  # a package: its submodules come from this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def installed() -> bool:
    """Whether ``av`` is (or will be) the stand-in in this process."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> bool:
    """Put the stand-in in front of PyAV; False (and nothing done) if ``av`` is already
    loaded. Idempotent."""
    if installed():
        return True
    if _PACKAGE in sys.modules:
        return False
    sys.meta_path.insert(0, _Finder())
    return True
