"""Quote untrusted data in an error message without ever building its full repr.

A refusal that writes ``{value!r}`` (even ``{value!r:.80}``, which truncates only *after*
the whole repr exists) lets a small file make us format gigabytes: a list of 100k memo
references to one 1 MB string is 1.5 MB on disk and 100 GB as a repr. :func:`short_repr`
walks at most a few levels and items of a container, cuts every string before it is
repr'd and never converts a big integer to decimal, so its cost and length are bounded
whatever it is given. Pure Python, no daisyweb imports: any module may use it.
"""

from __future__ import annotations

import itertools
import reprlib
from typing import Any

__all__ = ["short_repr", "short_name"]

_INT_BITS = 128  # a larger int is described by its size, never converted to decimal


class _BoundedRepr(reprlib.Repr):
    """reprlib with tight limits; strings and ints are cut before anything is formatted."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = 4
        self.maxfrozenset = self.maxdeque = self.maxarray = 4
        self.maxstring = self.maxother = self.maxlong = 40

    def repr_str(self, x: str, level: int) -> str:
        # reprlib.Repr.repr_str reprs the whole string first; cut it before.
        if len(x) <= self.maxstring:
            return repr(x)
        return repr(x[:self.maxstring]) + f"...({len(x)} chars)"

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > _INT_BITS:
            return f"<int of {x.bit_length()} bits>"
        return repr(x)

    def repr_dict(self, x: Any, level: int) -> str:
        # reprlib sorts the keys first (a full copy of a huge dict); take the first few.
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(x[k], level - 1)}"
                 for k in itertools.islice(x, self.maxdict)]
        more = ", ..." if len(x) > self.maxdict else ""
        return "{" + ", ".join(items) + more + "}"

    def repr_ndarray(self, x: Any, level: int) -> str:
        return f"<array {x.dtype} {x.shape}>"

    def repr_instance(self, x: Any, level: int) -> str:
        # Anything else is named by its type only: its own __repr__ is not ours to trust.
        return f"<{type(x).__name__}>"

    def repr1(self, x: Any, level: int) -> str:
        # Exact types only: a subclass of str or dict may override __repr__ or __len__.
        kind = type(x)
        if kind in (bool, float, type(None)):
            return repr(x)
        if kind is int:
            return self.repr_int(x, level)
        if kind is str:
            return self.repr_str(x, level)
        if kind in (list, tuple, dict):
            return super().repr1(x, level)
        if kind.__name__ == "OrderedDict" and kind.__module__ == "collections":
            return "OrderedDict(" + self.repr_dict(x, level) + ")"
        if kind.__name__ == "ndarray" and kind.__module__ == "numpy":
            return self.repr_ndarray(x, level)
        return self.repr_instance(x, level)


_REPR = _BoundedRepr()


def short_repr(obj: Any, limit: int = 80) -> str:
    """A repr of ``obj`` of at most ``limit`` characters, in time independent of its size.

    Containers show their first few items and nest at most two levels; long strings show
    a prefix and their length; big ints their bit length; other objects their type name.
    """
    text = _REPR.repr(obj)
    if len(text) > limit:
        text = text[:max(limit - 3, 0)] + "..."
    return text


def short_name(text: Any, limit: int = 60) -> str:
    """``text`` as is when it is a short printable string (a module or key name), else its
    :func:`short_repr`: a name from a file is shown, never able to format a terminal."""
    if type(text) is str and len(text) <= limit and text.isprintable():
        return text
    return short_repr(text, limit)
