"""The buffers one call of the model computes in, kept for the next call of its shape.

A training step allocates nothing big: its activations, their caches for the backward and
the backward's scratch are the buffers of a :class:`Workspace`, made on first use and
handed to the next call of the same kind and batch shape (:func:`take`, :func:`give`).
A workspace promises nothing about what its buffers hold: the caller writes every buffer
before it reads it in the same call, so nothing leaks from one call into the next.

A workspace's buffers are carved from anonymous maps of its own (:class:`Slabs`), which go
back to the system whole once the workspace and every view of it are gone. From malloc,
below a peer's mmap threshold (``daisyweb.peer.memory``), the freed blocks of a replaced
workspace would stay in the heap as holes that buffers of another shape do not fit.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["Slabs", "Workspace", "give", "take"]

_SLAB = 4 << 20  # bytes a workspace maps at a time for its buffers
_ALIGN = 64  # every buffer starts on a cache line
# Python maps anonymous memory shared unless told otherwise (POSIX); Windows has no flags
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


class Slabs:
    """Arrays carved one after the other from anonymous maps of ``_SLAB`` bytes or more,
    each starting on a cache line; the maps go back to the system when the last array
    viewing them is gone."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._free = 0  # bytes left at the end of the last map

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        count = math.prod(shape)
        nbytes = max(count * dtype.itemsize, 1)
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self._free:
            length = -(-max(size, _SLAB) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._maps.append(mmap.mmap(-1, length, **_PRIVATE))
            self._free = length
        block = self._maps[-1]
        offset = len(block) - self._free
        self._free -= size
        return np.frombuffer(block, dtype, count, offset).reshape(shape)

    def mapped(self) -> int:
        """Bytes mapped so far."""
        return sum(len(m) for m in self._maps)


class Workspace:
    """Every array one call needs, for one ``kind`` (what the caller computes), batch
    ``shape`` and default ``dtype``: named buffers, made on first use, and constants."""

    def __init__(self, kind: Hashable, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.kind = kind
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self._bufs: dict[tuple[str, int], np.ndarray] = {}
        self._constants: dict[str, np.ndarray] = {}
        self._slabs = Slabs()

    @property
    def key(self) -> tuple[Any, ...]:
        """What a call must match to reuse this workspace."""
        return self.kind, self.shape, self.dtype

    def __call__(self, name: str, shape: tuple[int, ...], layer: int = 0,
                 dtype: Any = None) -> np.ndarray:
        """The buffer ``name`` of ``layer`` (contents undefined until the caller writes
        them); every use of one name asks for one shape."""
        buf = self._bufs.get((name, layer))
        if buf is None:
            buf = self._bufs[(name, layer)] = self._slabs.array(
                shape, np.dtype(dtype or self.dtype))
        elif buf.shape != shape:  # two uses of one name: a bug, not a user error
            raise AssertionError(f"workspace {name} is {buf.shape}, asked for {shape}")
        return buf

    def constant(self, name: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        """The read-only array ``make()`` returns, made on first use and kept (not one of
        the buffers a call writes)."""
        value = self._constants.get(name)
        if value is None:
            value = self._constants[name] = make()
            value.flags.writeable = False
        return value

    def buffers(self) -> list[np.ndarray]:
        """Every buffer a call writes (tests poison them to show nothing leaks)."""
        return list(self._bufs.values())

    def mapped(self) -> int:
        """Bytes this workspace holds."""
        return self._slabs.mapped()


_POOL_MAX = 2  # idle workspaces kept (training batch + one evaluation shape)
_pool: list[Workspace] = []
_pool_lock = threading.Lock()


def _same_kind(work: Workspace, kind: Hashable, dtype: np.dtype) -> bool:
    return work.kind == kind and work.dtype == dtype


def _drop_other_shapes(key: tuple[Any, ...]) -> None:
    """Forget idle workspaces of ``key``'s kind for another batch shape (lock held): a
    peer whose share of the batch changes (capacity-weighted rows) would otherwise hold
    one for each shape it had, each one tens of MB for a training step."""
    kind, _, dtype = key
    _pool[:] = [w for w in _pool if w.key == key or not _same_kind(w, kind, dtype)]


def take(kind: Hashable, shape: tuple[int, ...], dtype: Any) -> Workspace:
    """An idle workspace for ``kind``, batch ``shape`` and ``dtype`` (a new one if none
    is idle): one per running call, so calls on several threads never share buffers. A
    new one replaces the idle ones of its kind for other shapes before it is made, so the
    two are never held at once."""
    key = (kind, shape, np.dtype(dtype))
    with _pool_lock:
        for i in range(len(_pool) - 1, -1, -1):
            if _pool[i].key == key:
                return _pool.pop(i)
        _drop_other_shapes(key)
    return Workspace(*key)


def give(work: Workspace) -> None:
    """Keep ``work`` for the next call of its key (its call is done with it)."""
    with _pool_lock:
        _drop_other_shapes(work.key)  # another thread's call may have made one meanwhile
        _pool.append(work)
        del _pool[:-_POOL_MAX]
