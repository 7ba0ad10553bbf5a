import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from daisyweb.protocol.averaging import (
    GradientError,
    Parts,
    average_in_roster_order,
    average_parts_in_roster_order,
    check_gradient,
    weighted_average_in_roster_order,
)
from daisyweb.protocol.codec import CODECS, Int4Codec, Int8Codec, decode_parts


def _grads(n: int, size: int = 1000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
            for _ in range(n)]


def test_average_matches_explicit_float32_loop() -> None:
    grads = _grads(4)
    expected = np.empty(1000, np.float32)
    for i in range(1000):
        acc = np.float32(grads[0][i])
        for g in grads[1:]:
            acc = np.float32(acc + g[i])
        expected[i] = np.float32(acc * np.float32(0.25))
    assert average_in_roster_order(grads).tobytes() == expected.tobytes()


def test_order_matters_so_roster_order_is_used() -> None:
    # Float addition is not associative: a permuted roster generally gives other bits,
    # which is why every replica must use the roster's order.
    a = np.array([1e8], np.float32)
    b = np.array([-1e8], np.float32)
    c = np.array([1.0], np.float32)
    assert average_in_roster_order([a, b, c])[0] != average_in_roster_order([a, c, b])[0]


def test_single_gradient_is_returned_unscaled_copy() -> None:
    g = _grads(1)[0]
    out = average_in_roster_order([g])
    assert out.tobytes() == g.tobytes() and out is not g


def test_inputs_are_not_modified() -> None:
    grads = _grads(3)
    before = [g.tobytes() for g in grads]
    average_in_roster_order(grads)
    assert [g.tobytes() for g in grads] == before


def test_refusals() -> None:
    with pytest.raises(GradientError):
        average_in_roster_order([])
    with pytest.raises(GradientError):
        average_in_roster_order([np.zeros(3, np.float32), np.zeros(4, np.float32)])
    with pytest.raises(GradientError):
        average_in_roster_order([np.zeros(3, np.float64)])


def test_check_gradient() -> None:
    good = np.zeros(5, np.float32)
    assert check_gradient(good, 5) is good
    with pytest.raises(GradientError, match="expected 5 values"):
        check_gradient(np.zeros(4, np.float32), 5)
    with pytest.raises(GradientError, match="float32"):
        check_gradient(np.zeros(5, np.float64), 5)
    bad = good.copy()
    bad[1] = np.nan
    bad[3] = np.inf
    with pytest.raises(GradientError, match="2 NaN/Inf"):
        check_gradient(bad, 5)


def test_gradients_may_come_one_at_a_time_from_a_generator() -> None:
    """The step machine decodes each contribution only when it is added (one vector of
    the roster in memory at a time): the same bits as from a list."""
    grads = _grads(4)
    assert (average_in_roster_order(g for g in grads).tobytes()
            == average_in_roster_order(grads).tobytes())
    shares = [3, 1, 2, 2]
    assert (weighted_average_in_roster_order((g for g in grads), shares).tobytes()
            == weighted_average_in_roster_order(grads, shares).tobytes())
    assert (weighted_average_in_roster_order((g for g in grads), [2] * 4).tobytes()
            == average_in_roster_order(grads).tobytes())
    with pytest.raises(GradientError, match="shares for"):
        weighted_average_in_roster_order((g for g in grads), [3, 1, 2])
    with pytest.raises(GradientError, match="shares for"):
        weighted_average_in_roster_order((g for g in grads), [3, 1, 2, 2, 5])
    with pytest.raises(GradientError, match="shares for"):
        weighted_average_in_roster_order((g for g in grads[:3]), [2, 2, 2, 2])
    with pytest.raises(GradientError):
        average_in_roster_order(g for g in [])


def _fresh(grads: list[np.ndarray]) -> Iterator[np.ndarray]:
    """Each of ``grads`` as a new copy made only when asked for, as a decoder makes them."""
    for g in grads:
        yield g.copy()


def test_owned_vectors_give_the_same_bits_and_the_first_becomes_the_sum() -> None:
    grads = _grads(4)
    for shares in ([3, 1, 2, 2], [2, 2, 2, 2]):
        want = weighted_average_in_roster_order(grads, shares)
        made = list(_fresh(grads))
        got = weighted_average_in_roster_order(iter(made), shares, owned=True)
        assert got.tobytes() == want.tobytes() and got is made[0]
    got = average_in_roster_order(_fresh(grads), owned=True)
    assert got.tobytes() == average_in_roster_order(grads).tobytes()


def _peak_vectors(average: Callable[[Iterator[np.ndarray]], np.ndarray]) -> float:
    """Most bytes held at once while ``average`` sums four freshly made vectors, in vectors."""
    size = 1 << 18
    grads = _grads(4, size)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        average(_fresh(grads))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / (4 * size)


@pytest.mark.parametrize("shares", [None, [3, 1, 2, 2], [2, 2, 2, 2]])
def test_owned_vectors_are_summed_holding_two_at_a_time(shares: list[int] | None) -> None:
    """What a commit holds: the sum and the one vector being added; not a copy of the
    first, a scratch vector, nor the one added before (each 5.3 MB at the demo default;
    holding any of them makes it three)."""
    if shares is None:
        peak = _peak_vectors(lambda gs: average_in_roster_order(gs, owned=True))
    else:
        peak = _peak_vectors(lambda gs: weighted_average_in_roster_order(gs, shares,
                                                                         owned=True))
    assert peak < 2.1


def _parts(vector: np.ndarray, step: int) -> Parts:
    for start in range(0, vector.size, step):
        yield slice(start, min(start + step, vector.size)), vector[start:start + step].copy()


@pytest.mark.parametrize("shares", [(), (2, 2, 2), (3, 1, 2), (5,)])
@pytest.mark.parametrize("codec", [CODECS["f32"], CODECS["int8"], CODECS["int4"],
                                   Int8Codec(block=7), Int4Codec(block=3)])
def test_decoded_part_by_part_the_average_has_the_same_bits(
        codec: Int8Codec, shares: tuple[int, ...]) -> None:
    """What a commit computes from the payloads' parts is what the whole-vector averages
    compute from the decoded vectors, bit for bit (a size that is no multiple of a part,
    a block or two; blocks of odd sizes)."""
    size = 3 * 65536 + 1001
    vectors = _grads(len(shares) or 3, size, seed=len(shares))
    payloads = [codec.encode(v) for v in vectors]
    decoded = [codec.decode(b, size) for b in payloads]
    if len(set(shares)) > 1:
        want = weighted_average_in_roster_order(decoded, list(shares))
    else:
        want = average_in_roster_order(decoded)
    got = average_parts_in_roster_order([decode_parts(codec, b, size) for b in payloads],
                                        size, shares)
    assert got.tobytes() == want.tobytes()
    whole = np.concatenate([values for _, values in decode_parts(codec, payloads[0], size)])
    assert whole.tobytes() == decoded[0].tobytes()


def test_parts_that_do_not_line_up_are_refused() -> None:
    a, b = _grads(2, 1000)
    with pytest.raises(GradientError, match="different ranges"):
        average_parts_in_roster_order([_parts(a, 100), _parts(b, 200)], 1000)
    with pytest.raises(GradientError, match="different lengths"):
        average_parts_in_roster_order([_parts(a, 100), _parts(b[:900], 100)], 1000)
    with pytest.raises(GradientError, match="cover 900 of 1000"):
        average_parts_in_roster_order([_parts(a[:900], 100), _parts(b[:900], 100)], 1000)
    with pytest.raises(GradientError, match="expected one from 0"):
        average_parts_in_roster_order([iter([(slice(100, 1000), a[100:].copy())])], 1000)
    with pytest.raises(GradientError, match="same shape"):
        average_parts_in_roster_order([iter([(slice(0, 1000), a[:10].copy())])], 1000)
    with pytest.raises(GradientError, match="empty roster"):
        average_parts_in_roster_order([], 1000)
    with pytest.raises(GradientError, match="2 shares for 1"):
        average_parts_in_roster_order([_parts(a, 100)], 1000, (1, 2))
    with pytest.raises(GradientError, match="positive integers"):
        average_parts_in_roster_order([_parts(a, 100), _parts(b, 100)], 1000, (0, 2))


def test_a_bad_payload_is_refused_before_any_part() -> None:
    """decode_parts validates as decode does: a payload decode refuses yields nothing."""
    size = 70000
    good = CODECS["int4"].encode(_grads(1, size)[0])
    bad = bytearray(good)
    bad[0:4] = np.float32(np.inf).tobytes()  # the first scale
    for codec in (CODECS["int4"], CODECS["int8"], CODECS["f32"]):
        with pytest.raises(GradientError):
            next(decode_parts(codec, bytes(bad), size))
    with pytest.raises(GradientError, match="expected"):
        next(decode_parts(CODECS["int4"], good[:-1], size))


def test_a_commit_holds_the_sum_and_one_part_per_member() -> None:
    """Averaging three int4 payloads of the demo default's size holds the sum and small
    parts, not a whole decoded vector besides it (that was two vectors at the peak)."""
    size = 1_325_824
    codec = CODECS["int4"]
    payloads = [codec.encode(v) for v in _grads(3, size)]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        average_parts_in_roster_order([decode_parts(codec, b, size) for b in payloads], size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * size + 3 * (1 << 20)
