"""Bounded influence (``daisyweb.protocol.influence``): norms every member computes alike,
and the clip that keeps one member from moving the mean more than a fair share."""

from __future__ import annotations

import math

import numpy as np
import pytest

from daisyweb.protocol.averaging import average_parts_in_roster_order
from daisyweb.protocol.codec import INT4, INT8, codec_by_name
from daisyweb.protocol.influence import CHUNK, clip_factors, squared_norm, tree_sum
from tests.daisyweb.protocol.test_sync import SIZE, Bus, grad_for


def _parts(v: np.ndarray, step: int):
    for lo in range(0, v.size, step):
        yield slice(lo, min(lo + step, v.size)), v[lo:lo + step].copy()


def test_tree_sum_is_a_fixed_pairwise_tree() -> None:
    assert tree_sum(np.array([])) == 0.0 and tree_sum(np.array([3.0])) == 3.0
    # ((a + c) + (b + d)) for [a, b, c, d]: not the left-to-right sum
    v = np.array([1e16, 1.0, -1e16, 1.0])
    assert tree_sum(v) == 2.0 and sum(v.tolist()) == 1.0
    assert tree_sum(np.array([1.0, 2.0, 3.0])) == 6.0  # zero-padded to four


@pytest.mark.parametrize("size", [1, 1000, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_the_norm_is_the_same_whatever_the_parts(size: int) -> None:
    v = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    norms = {squared_norm(_parts(v, step)) for step in (1 << 16, 1000, 4097, size)}
    assert len(norms) == 1
    assert math.isclose(norms.pop(), float(np.sum(v.astype(np.float64) ** 2)), rel_tol=1e-12)


@pytest.mark.parametrize("name", ["f32", "int8", "int4"])
def test_the_norm_of_a_payload_decoded_by_parts_equals_the_whole_vectors(name: str) -> None:
    codec = codec_by_name(name)
    size = 2 * CHUNK + 333
    payload = codec.encode(np.random.default_rng(1).standard_normal(size).astype(np.float32))
    whole = codec.decode(payload, size)
    assert squared_norm(codec.decode_parts(payload, size)) == squared_norm([(slice(0, size),
                                                                             whole)])


def test_clip_factors_bound_each_norm_to_twice_the_lower_median() -> None:
    assert clip_factors([]) == ()
    assert clip_factors([4.0]) == (None,)  # a member alone is its own median
    f = clip_factors([1.0, 4.0, 100.0 ** 2])  # norms 1, 2, 100; median 2; bound 4
    assert f[0] is None and f[1] is None and f[2] == np.float32(4.0 / 100.0)
    # two members: the lower is the median, the larger one is held to twice it
    assert clip_factors([1.0, 9.0]) == (None, np.float32(2.0 / 3.0))
    # a zero contribution as the median holds the others at zero
    assert clip_factors([0.0, 0.0, 1.0]) == (None, None, np.float32(0.0))


def test_factors_scale_a_members_values_before_the_roster_order_sum() -> None:
    rng = np.random.default_rng(2)
    vs = [rng.standard_normal(CHUNK + 5).astype(np.float32) for _ in range(3)]
    factors = (None, np.float32(0.25), None)
    got = average_parts_in_roster_order([_parts(v, CHUNK) for v in vs], vs[0].size, (),
                                        factors)
    want = ((vs[0] + vs[1] * np.float32(0.25)) + vs[2]) * np.float32(1.0 / 3)
    assert np.array_equal(got, want)
    plain = average_parts_in_roster_order([_parts(v, CHUNK) for v in vs], vs[0].size)
    assert not np.array_equal(got, plain)


def test_a_shifted_contribution_is_clipped_by_every_member_alike() -> None:
    # b adds 0.7 to every value of its contributions (issue 37's finite attack)
    def grad(peer: str, step: int) -> np.ndarray:
        g = grad_for(peer, step)
        return g + np.float32(50.0) if peer == "b" else g

    bus = Bus(["a", "b", "c"], steps=4, grad=grad)
    bus.start()
    bus.run()
    assert set(bus.finished) == {"a", "b", "c"}
    assert {bus.replicas[p].weight_hash() for p in "abc"} == {bus.replicas["a"].weight_hash()}
    for p in "abc":
        assert all(c.clipped == ("b",) for c in bus.commits[p])
    # what b moved the mean by is at most twice the median norm, over the roster
    g = {p: grad(p, 0) for p in "abc"}
    norms = sorted(float(np.linalg.norm(v)) for v in g.values())
    mean = bus.replicas["a"].applied[0]
    honest = (g["a"] + g["c"]) / 3
    assert float(np.linalg.norm(mean - honest)) <= 2 * norms[1] / 3 * (1 + 1e-5)


@pytest.mark.parametrize("codec", [INT8, INT4])
def test_huge_finite_scales_cannot_poison_the_mean(codec) -> None:
    # A member whose every scale is 2**120 and every value the largest: finite, valid
    # bytes, and without the clip a mean with values near 2**127 (or Inf).
    size = SIZE
    honest = [codec.encode(grad_for(p, 0)) for p in ("a", "c")]
    nb = codec.nblocks(size)
    scales = np.full(nb, 2.0 ** 120, np.float32).tobytes()
    values = codec.encode(np.full(size, 1.0, np.float32))[4 * nb:]
    hostile = scales + values
    codec.check(hostile, size)  # the bytes pass the codec's checks
    payloads = [honest[0], hostile, honest[1]]
    norms2 = [squared_norm(codec.decode_parts(p, size)) for p in payloads]
    factors = clip_factors(norms2)
    mean = average_parts_in_roster_order([codec.decode_parts(p, size) for p in payloads],
                                         size, (), factors)
    assert np.isfinite(mean).all() and float(np.abs(mean).max()) < 10.0
    assert factors[1] is not None and factors[0] is None and factors[2] is None


class EquivocatingBus(Bus):
    """``c`` sends ``b`` other bytes than everyone else, for step 0."""

    def handle(self, peer: str, actions: list) -> None:
        from collections import deque

        from daisyweb.protocol import wire
        from daisyweb.protocol.sync import Send

        rest = []
        for a in actions:
            msg = getattr(a, "message", None)
            if (peer == "c" and isinstance(a, Send) and isinstance(msg, wire.Contribution)
                    and msg.step == 0):
                other = wire.Contribution(0, "c", (grad_for("c", 0) * 2).astype("<f4").tobytes())
                for q in a.to or ():
                    sent = other if q == "b" else msg
                    self.queues.setdefault((peer, q), deque()).append(wire.encode(sent))
                continue
            rest.append(a)
        super().handle(peer, rest)


def test_equivocation_is_blamed_on_its_sender_by_every_member() -> None:
    bus = EquivocatingBus(["a", "b", "c"], steps=3)
    bus.start()
    bus.run()
    assert set(bus.stopped) == {"a", "b", "c"}, bus.stopped
    for p in "ab":
        reason = bus.stopped[p].reason
        assert "c sent different contributions of step 0" in reason, reason
        assert "equivocation" in reason
