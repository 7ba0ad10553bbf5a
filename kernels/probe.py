"""Cross-machine kernel probe: a fixed seeded int8 GEMM through the live backend, hashed.

The operands come from a counter-based integer hash (splitmix64-style finaliser on uint64
counters), so they do not depend on the numpy version or its random generators; the hash is
blake2b of the int32 little-endian result bytes. Equal on every honest machine.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .dispatch import gemm_int8

PROBE_M, PROBE_K, PROBE_N = 64, 96, 80
PROBE_SEED_A, PROBE_SEED_B = 1, 2


def hash_data(n: int, seed: int) -> np.ndarray:
    """n int8 values from a stateless integer hash of (seed, counter)."""
    i = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    i ^= i >> np.uint64(33)
    with np.errstate(over="ignore"):
        i *= np.uint64(0xFF51AFD7ED558CCD)
    i ^= i >> np.uint64(33)
    return (i & np.uint64(0xFF)).astype(np.uint8).view(np.int8)


def probe_operands() -> tuple[np.ndarray, np.ndarray]:
    a = hash_data(PROBE_M * PROBE_K, PROBE_SEED_A).reshape(PROBE_M, PROBE_K)
    b = hash_data(PROBE_K * PROBE_N, PROBE_SEED_B).reshape(PROBE_K, PROBE_N)
    return a, b


def probe_hash() -> str:
    """blake2b hex digest of the probe GEMM's int32 little-endian result bytes."""
    a, b = probe_operands()
    acc = gemm_int8(a, b)
    return hashlib.blake2b(acc.astype("<i4").tobytes()).hexdigest()
