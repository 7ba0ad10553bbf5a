"""A pickle reader that admits only what a ``.pt`` checkpoint's ``data.pkl`` needs.

:class:`pickle.Unpickler` runs any opcode on any object: ``BUILD`` sets attributes of
whatever is on the stack (a reader's own storage object included), ``REDUCE`` calls
whatever ``find_class`` returned, and its memo lets a tiny pickle reference one object
without limit. This module is a small stack machine of its own instead, with

* only the binary opcodes of pickle protocols 2-5 that ``torch.save`` and our writer
  emit (no ``BUILD`` on anything but an ``OrderedDict``'s ``_metadata``, no ``INST``,
  ``OBJ``, ``NEWOBJ``, ``EXT``, bytes, sets, text-mode opcodes or ``LONG4``);
* only the globals the caller allows, as inert markers: ``REDUCE`` may call
  ``collections.OrderedDict()`` without arguments and the caller's tensor rebuild, and
  ``BINPERSID`` hands a tuple to the caller's storage loader; nothing else is callable;
* dicts whose keys are ``str`` or ``int`` (so no hostile object is ever hashed), appends
  only to lists, item assignment only to dicts;
* bounded memory: every value the machine creates, every reference it pushes, memoizes
  or stores in a container is charged its size in bytes (``sys.getsizeof`` for a new
  object, a pointer for a reference, a measured entry size for dicts and the memo), and
  the total may not pass ``memory_limit(len(pickle))``: a small multiple of the pickle's
  size, capped by :data:`MAX_MEMORY`. An opcode is either charged or consumes a value
  that was, so the work is bounded by the pickle's size and the same number.

Every problem raises :class:`PickleRefused` (a ``ValueError``) with a short message
naming the opcode and its byte offset.
"""

from __future__ import annotations

import collections
import struct
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PickleRefused", "Global", "load_restricted", "memory_limit", "MAX_MEMORY"]

# What the objects a pickle builds may cost, in bytes. A real data.pkl is charged 7-18
# bytes per pickle byte (ours ~8, torch's state_dicts ~15-18: the tests measure it); 32
# leaves room and keeps a 1 KB hostile pickle to about a megabyte. The cap is 17 times
# what torch's pickle of the largest model ModelConfig admits (1024 layers) needs.
MEMORY_PER_PICKLE_BYTE = 32
MEMORY_FLOOR = 1 << 20
MAX_MEMORY = 512 << 20

# Measured sizes (CPython 3.11, 64-bit) of what the machine stores besides new objects.
_REF = 8  # a pointer on the stack or in a list
_DICT_ENTRY = 64  # one more key in a dict (entry, index, over-allocation)
_ODICT_ENTRY = 128  # one more key in an OrderedDict (plus its linked-list node)
_MEMO_ENTRY = _DICT_ENTRY
_TENSOR = 128  # the ndarray object of a rebuilt tensor (its data is the caller's budget)
_SMALL_INT_MIN, _SMALL_INT_MAX = -5, 256  # ints CPython never allocates anew


class PickleRefused(ValueError):
    """The pickle uses something a checkpoint never needs, or is malformed."""


class Global:
    """An allowed ``module.name`` global: a marker, never a callable."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __repr__(self) -> str:
        return f"<global {self.module}.{self.name}>"


ORDERED_DICT = ("collections", "OrderedDict")
_METADATA_ATTR = "_metadata"  # the one attribute torch's state_dict() OrderedDict carries
_DICT_TYPES = (dict, collections.OrderedDict)
_KEY_TYPES = (str, int)
_MAX_INT_BYTES = 255  # LONG1: plenty for a seed (2**64) or a size; LONG4 is refused
_FIRST_PROTOCOL, _LAST_PROTOCOL = 2, 5

FindGlobal = Callable[[str, str], Any]
Rebuild = Callable[[Global, tuple], Any]
PersistentLoad = Callable[[Any], Any]


class _Machine:
    def __init__(self, data: bytes, find_global: FindGlobal, rebuild: Rebuild,
                 persistent_load: PersistentLoad, max_memory: int) -> None:
        self.data = data
        self.pos = 0
        self.op_pos = 0
        self.op_name = ""
        self.stack: list[Any] = []
        self.marks: list[int] = []  # stack lengths at each open MARK
        self.memo: dict[int, Any] = {}
        self.memory_left = max_memory
        self.find_global = find_global
        self.rebuild = rebuild
        self.persistent_load = persistent_load

    # ------------------------------------------------------------------ plumbing
    def refuse(self, why: str) -> PickleRefused:
        return PickleRefused(f"{why} ({self.op_name} at byte {self.op_pos})")

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.refuse("truncated pickle")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def charge(self, nbytes: int) -> None:
        self.memory_left -= nbytes
        if self.memory_left < 0:
            raise self.refuse("pickle builds too many objects for its size")

    def push(self, value: Any) -> None:
        """Push a reference to an object that already exists (memo, marker, singleton)."""
        self.charge(_REF)
        self.stack.append(value)

    def push_new(self, value: Any) -> None:
        """Push an object the machine just created, charged its own size too."""
        self.charge(sys.getsizeof(value))
        self.push(value)

    def push_int(self, value: int) -> None:
        # CPython shares the small ints; charging them as new would refuse real files
        # (a dict of small ints is 4 pickle bytes an entry).
        if _SMALL_INT_MIN <= value <= _SMALL_INT_MAX:
            self.push(value)
        else:
            self.push_new(value)

    def pop(self) -> Any:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise self.refuse("pickle stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise self.refuse("pickle stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.refuse("no MARK on the pickle stack")
        start = self.marks.pop()
        # The slice is a second list of these references until the caller consumes it.
        self.charge(_REF * (len(self.stack) - start))
        items = self.stack[start:]
        del self.stack[start:]
        return items

    # ------------------------------------------------------------------ values
    def long1(self) -> None:
        n = self.unpack("<B")
        self.push_int(int.from_bytes(self.take(n), "little", signed=True))

    def text(self, n: int) -> None:
        raw = self.take(n)
        try:
            text = raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.refuse("string is not UTF-8") from None
        self.push_new(text)

    def global_line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise self.refuse("truncated pickle")
        raw = self.take(end - self.pos + 1)[:-1]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse("global name is not UTF-8") from None

    def resolve(self, module: Any, name: Any) -> None:
        if type(module) is not str or type(name) is not str:
            raise self.refuse("global name is not a string")
        if (module, name) == ORDERED_DICT:
            self.push(Global(module, name))
        else:
            self.push(self.find_global(module, name))

    # ------------------------------------------------------------------ containers
    def set_items(self, target: Any, items: list[Any]) -> None:
        if type(target) not in _DICT_TYPES:
            raise self.refuse(f"item assignment to a {type(target).__name__}")
        if len(items) % 2:
            raise self.refuse("odd number of dict items")
        for k, v in zip(items[::2], items[1::2], strict=True):
            if type(k) not in _KEY_TYPES:
                raise self.refuse(f"dict key of type {type(k).__name__}")
            if k not in target:
                is_plain = type(target) is dict
                self.charge(_DICT_ENTRY if is_plain else _ODICT_ENTRY)
            target[k] = v

    def append_items(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            raise self.refuse(f"append to a {type(target).__name__}")
        self.charge(_REF * len(items))
        target.extend(items)

    def reduce(self) -> None:
        args = self.pop()
        func = self.pop()
        if not isinstance(func, Global):
            raise self.refuse(f"call of a {type(func).__name__}")
        if type(args) is not tuple:
            raise self.refuse("call arguments are not a tuple")
        if (func.module, func.name) == ORDERED_DICT:
            if args:
                raise self.refuse("OrderedDict with arguments")
            self.push_new(collections.OrderedDict())
        else:
            self.charge(_TENSOR)
            self.push(self.rebuild(func, args))

    def build(self) -> None:
        # torch's state_dict() is an OrderedDict with a ``_metadata`` attribute, pickled
        # as BUILD with {"_metadata": ...}; that is the only state anything may get.
        state = self.pop()
        target = self.top()
        if type(target) is not collections.OrderedDict:
            raise self.refuse(f"BUILD on a {type(target).__name__}")
        if type(state) is not dict or set(state) != {_METADATA_ATTR} or vars(target):
            raise self.refuse("BUILD with other state than one _metadata")
        self.charge(sys.getsizeof({}) + _DICT_ENTRY)  # the instance __dict__
        target._metadata = state[_METADATA_ATTR]  # type: ignore[attr-defined]

    def memo_put(self, index: int) -> None:
        if index not in self.memo:
            self.charge(_MEMO_ENTRY)
        self.memo[index] = self.top()

    def memo_get(self, index: int) -> None:
        if index not in self.memo:
            raise self.refuse(f"memo entry {index} was never stored")
        self.push(self.memo[index])

    # ------------------------------------------------------------------ the loop
    def run(self) -> Any:
        data = self.data
        if data[:1] != b"\x80":
            self.op_name = "start"
            raise self.refuse("pickle does not start with PROTO")
        ops = _OPS
        while True:
            self.op_pos = self.pos
            if self.pos >= len(data):
                self.op_name = "end"
                raise self.refuse("pickle has no STOP")
            code = data[self.pos]
            self.pos += 1
            entry = ops.get(code)
            if entry is None:
                self.op_name = _opcode_name(code)
                raise self.refuse("refusing pickle opcode")
            self.op_name, handler = entry
            if handler(self):
                break
        if self.pos != len(data):
            raise self.refuse("data after STOP")
        if self.marks or len(self.stack) != 1:
            raise self.refuse("pickle stack does not end with one value")
        return self.stack[0]


def _opcode_name(code: int) -> str:
    import pickletools  # only for the message of a refused opcode

    for op in pickletools.opcodes:
        if op.code.encode("latin-1") == bytes([code]):
            return op.name
    return f"byte 0x{code:02x}"


def _proto(m: _Machine) -> None:
    version = m.unpack("<B")
    if m.op_pos != 0 or not _FIRST_PROTOCOL <= version <= _LAST_PROTOCOL:
        raise m.refuse(f"pickle protocol {version}")


def _frame(m: _Machine) -> None:
    # Protocol 4 framing is a read-ahead hint; the length only has to be plausible.
    if m.unpack("<Q") > len(m.data) - m.pos:
        raise m.refuse("frame runs past the pickle")


def _stop(m: _Machine) -> bool:
    return True


def _mark(m: _Machine) -> None:
    m.charge(_REF)
    m.marks.append(len(m.stack))


def _pop(m: _Machine) -> None:
    if m.marks and len(m.stack) == m.marks[-1]:
        m.marks.pop()  # POP of a MARK, as pickle does
    else:
        m.pop()


def _pop_mark(m: _Machine) -> None:
    m.pop_mark()


def _tuple_n(n: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        items = [m.pop() for _ in range(n)][::-1]
        m.push_new(tuple(items))
    return op


def _tuple(m: _Machine) -> None:
    m.push_new(tuple(m.pop_mark()))


def _list(m: _Machine) -> None:
    items = m.pop_mark()
    m.push_new(items)


def _dict(m: _Machine) -> None:
    target: dict[Any, Any] = {}
    items = m.pop_mark()
    m.push_new(target)
    m.set_items(target, items)


def _append(m: _Machine) -> None:
    value = m.pop()
    m.append_items(m.top(), [value])


def _appends(m: _Machine) -> None:
    items = m.pop_mark()
    m.append_items(m.top(), items)


def _setitem(m: _Machine) -> None:
    value = m.pop()
    key = m.pop()
    m.set_items(m.top(), [key, value])


def _setitems(m: _Machine) -> None:
    items = m.pop_mark()
    m.set_items(m.top(), items)


def _global(m: _Machine) -> None:
    module = m.global_line()
    name = m.global_line()
    m.resolve(module, name)


def _stack_global(m: _Machine) -> None:
    name = m.pop()
    module = m.pop()
    m.resolve(module, name)


def _binpersid(m: _Machine) -> None:
    m.charge(_TENSOR)
    m.push(m.persistent_load(m.pop()))


def _long4(m: _Machine) -> None:
    raise m.refuse(f"integer of more than {_MAX_INT_BYTES} bytes")


_OPS: dict[int, tuple[str, Callable[[_Machine], Any]]] = {
    ord(code): (name, fn) for code, name, fn in [
        ("\x80", "PROTO", _proto),
        ("\x95", "FRAME", _frame),
        (".", "STOP", _stop),
        ("(", "MARK", _mark),
        ("0", "POP", _pop),
        ("1", "POP_MARK", _pop_mark),
        ("N", "NONE", lambda m: m.push(None)),
        ("\x88", "NEWTRUE", lambda m: m.push(True)),
        ("\x89", "NEWFALSE", lambda m: m.push(False)),
        ("J", "BININT", lambda m: m.push_int(m.unpack("<i"))),
        ("K", "BININT1", lambda m: m.push_int(m.unpack("<B"))),
        ("M", "BININT2", lambda m: m.push_int(m.unpack("<H"))),
        ("\x8a", "LONG1", _Machine.long1),
        ("\x8b", "LONG4", _long4),
        ("G", "BINFLOAT", lambda m: m.push_new(m.unpack(">d"))),
        ("X", "BINUNICODE", lambda m: m.text(m.unpack("<I"))),
        ("\x8c", "SHORT_BINUNICODE", lambda m: m.text(m.unpack("<B"))),
        ("\x8d", "BINUNICODE8", lambda m: m.text(m.unpack("<Q"))),
        (")", "EMPTY_TUPLE", lambda m: m.push(())),
        ("t", "TUPLE", _tuple),
        ("\x85", "TUPLE1", _tuple_n(1)),
        ("\x86", "TUPLE2", _tuple_n(2)),
        ("\x87", "TUPLE3", _tuple_n(3)),
        ("]", "EMPTY_LIST", lambda m: m.push_new([])),
        ("l", "LIST", _list),
        ("a", "APPEND", _append),
        ("e", "APPENDS", _appends),
        ("}", "EMPTY_DICT", lambda m: m.push_new({})),
        ("d", "DICT", _dict),
        ("s", "SETITEM", _setitem),
        ("u", "SETITEMS", _setitems),
        ("q", "BINPUT", lambda m: m.memo_put(m.unpack("<B"))),
        ("r", "LONG_BINPUT", lambda m: m.memo_put(m.unpack("<I"))),
        ("\x94", "MEMOIZE", lambda m: m.memo_put(len(m.memo))),
        ("h", "BINGET", lambda m: m.memo_get(m.unpack("<B"))),
        ("j", "LONG_BINGET", lambda m: m.memo_get(m.unpack("<I"))),
        ("c", "GLOBAL", _global),
        ("\x93", "STACK_GLOBAL", _stack_global),
        ("R", "REDUCE", _Machine.reduce),
        ("b", "BUILD", _Machine.build),
        ("Q", "BINPERSID", _binpersid),
    ]
}


def load_restricted(data: bytes, *, find_global: FindGlobal, rebuild: Rebuild,
                    persistent_load: PersistentLoad, max_memory: int | None = None) -> Any:
    """The value ``data`` pickles, built by the restricted machine (see module doc).

    ``find_global(module, name)`` returns a :class:`Global` (or any inert value, e.g. a
    storage type) or raises; ``collections.OrderedDict`` is built in. ``REDUCE`` of any
    other :class:`Global` calls ``rebuild(global, args)``; ``BINPERSID`` calls
    ``persistent_load(pid)``. Their exceptions propagate unchanged. The objects built may
    cost at most ``max_memory`` bytes (default :func:`memory_limit` of the pickle's size).
    """
    limit = memory_limit(len(data)) if max_memory is None else max_memory
    return _Machine(data, find_global, rebuild, persistent_load, limit).run()


def memory_limit(pickle_bytes: int) -> int:
    """What the objects of a pickle of this many bytes may cost (see module doc)."""
    return min(MAX_MEMORY, MEMORY_PER_PICKLE_BYTE * pickle_bytes + MEMORY_FLOOR)
