"""bench.rounds_sim's owner exchange: the product's owner math in a simulated group."""

from __future__ import annotations

import pytest

from bench.rounds_sim import simulate


def test_the_owner_exchange_without_its_roundings_trains_as_all_to_all() -> None:
    # f32 and no clip: the owners' means are all-to-all's bit for bit, so is the curve
    kw = dict(peers=3, steps=8, sync_every=4, codec="f32", clip=False, batch=2,
              eval_every=4)
    assert (simulate(exchange="owner", **kw).curve == simulate(exchange="all", **kw).curve)


def test_the_owner_exchange_sends_fewer_bytes_with_the_same_codec() -> None:
    kw = dict(peers=4, steps=8, sync_every=4, codec="int4", batch=2, eval_every=8)
    every, owner = simulate(exchange="all", **kw), simulate(exchange="owner", **kw)
    # 3 contributions a round against about 3/4 + 3/4 of one
    assert owner.sent_by_first < 0.55 * every.sent_by_first
    assert abs(owner.final - every.final) < 0.05  # and trains alike at this size
    with pytest.raises(ValueError):
        simulate(exchange="ring", **kw)
