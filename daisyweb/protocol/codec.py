"""Codecs for what members exchange each step or round: float32 vectors <-> payload bytes.

Every member decodes the *same bytes* (its own included) and averages the decoded
vectors, so a lossy codec still leaves every replica bit-identical. ``decode`` is the
validating side: a wrong length or any NaN/Inf raises :class:`GradientError`, exactly as
a bad raw gradient does.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from daisyweb.protocol.averaging import GradientError, check_gradient

__all__ = ["Codec", "F32Codec", "F32", "codec_by_name", "CODECS"]


class Codec(Protocol):
    """Turns a float32 vector into payload bytes and back (validated)."""

    name: str

    def encode(self, vector: np.ndarray) -> bytes: ...

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray: ...


class F32Codec:
    """Little-endian float32, lossless: what lockstep gradients have always been."""

    name = "f32"

    def encode(self, vector: np.ndarray) -> bytes:
        return np.ascontiguousarray(vector, dtype="<f4").tobytes()

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        if len(payload) != 4 * size:
            raise GradientError(f"{who}: expected {size} values, got {len(payload)} bytes")
        return check_gradient(np.frombuffer(payload, dtype="<f4").astype(np.float32), size, who)


F32 = F32Codec()
CODECS: dict[str, Codec] = {"f32": F32}


def codec_by_name(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None
