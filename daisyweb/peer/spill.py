"""What a leader keeps rarely, in a file instead of memory: its older repair payloads.

The leader keeps every member's payloads of the last ``sync.HISTORY`` committed steps
(8 rounds) to resend them to a member that fell behind; only the last
two are ever asked for in practice (``ledger.HOT_STEPS``), and the rest grow with the
group: 8 rounds x N members x 0.74 MB at the demo default (int4), 8 x N x 5.3 MB in
lockstep f32. :class:`SpillArchive` writes each older step's payloads to a file of its
own, deleted from the directory at once (so it goes when the peer does, however it
ends) and closed when the step is forgotten. A payload read back is checked against
the digest taken when it was written: one the disk did not give back intact is not
resent (as if forgotten; the member asking is repaired or excluded as then). A CRC-32
(0.3 ms for an int4 payload, a quarter of blake2b's time on the event loop) is enough
against a disk's accidents; what a payload means is checked by every member that
decodes it anyway (the codec's checks, the shared-state hashes).

The file lives in ``$TMPDIR`` if set, else ``/var/tmp`` (on disk where ``/tmp`` is a
RAM-backed tmpfs, which would keep the bytes in memory after all), else the system's
temporary directory. If a file cannot be made or written, the step's payloads stay in
memory and the peer says so once.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from daisyweb.peer.options import log

__all__ = ["SpillArchive", "SpilledPayloads", "spill_dir"]


def spill_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where spill files go: ``$TMPDIR``, else ``/var/tmp`` if writable, else the
    system's temporary directory."""
    env = os.environ if environ is None else environ
    if env.get("TMPDIR"):
        return env["TMPDIR"]
    if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK | os.X_OK):
        return "/var/tmp"
    return tempfile.gettempdir()


def _digest(data: bytes) -> int:
    return zlib.crc32(data)


class SpilledPayloads(Mapping[str, bytes]):
    """One step's payloads by sender, in an unlinked file; each read is checked."""

    def __init__(self, file: BinaryIO, where: dict[str, tuple[int, int, int]]) -> None:
        self._file = file
        self._where = where  # sender -> (offset, length, CRC-32)

    def __getitem__(self, sender: str) -> bytes:
        offset, length, digest = self._where[sender]
        try:
            data = os.pread(self._file.fileno(), length, offset)
        except (OSError, ValueError) as exc:  # ValueError: the file was closed
            raise KeyError(sender) from exc
        if len(data) != length or _digest(data) != digest:
            log(f"repair payload of {sender} did not read back intact from its spill "
                f"file; not resending it")
            raise KeyError(sender)
        return data

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._file.close()

    def __del__(self) -> None:
        self._file.close()


class SpillArchive:
    """A :class:`daisyweb.protocol.ledger.Archive` of files in :func:`spill_dir`."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or spill_dir()
        self.failed = False  # said once: later steps stay in memory quietly

    def keep(self, step: int, payloads: dict[str, bytes]) -> Mapping[str, bytes]:
        try:
            file = tempfile.TemporaryFile(dir=self.directory, prefix="daisyweb-repair-")
        except OSError as exc:
            return self._in_memory(payloads, exc)
        where: dict[str, tuple[int, int, int]] = {}
        offset = 0
        try:
            for sender, payload in payloads.items():
                file.write(payload)
                where[sender] = (offset, len(payload), _digest(payload))
                offset += len(payload)
            file.flush()
        except OSError as exc:
            file.close()
            return self._in_memory(payloads, exc)
        return SpilledPayloads(file, where)

    def _in_memory(self, payloads: dict[str, bytes], exc: OSError) -> dict[str, bytes]:
        if not self.failed:
            self.failed = True
            log(f"cannot keep repair payloads in {self.directory} ({exc}); "
                f"keeping them in memory")
        return dict(payloads)
