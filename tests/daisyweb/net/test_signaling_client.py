"""Tests for daisyweb.net.signaling_client that need no server (the live ones are in
test_mesh.py: admission, approval, dashboard decisions, status coalescing)."""

from __future__ import annotations

from typing import Any

import pytest

from daisyweb.net.signaling_client import SignalingClient, ws_url


def test_ws_url():
    assert ws_url("http://127.0.0.1:8787") == "ws://127.0.0.1:8787/ws"
    assert ws_url("https://x.example/base/") == "wss://x.example/base/ws"
    assert ws_url("ws://127.0.0.1:1/ws") == "ws://127.0.0.1:1/ws"
    with pytest.raises(ValueError):
        ws_url("ftp://127.0.0.1")


class Recorder:
    def __init__(self) -> None:
        self.members: list[tuple[tuple[str, ...], bool]] = []
        self.signals: list[tuple[str, str, dict[str, Any]]] = []

    def on_members(self, old: tuple[str, ...], changed: bool) -> None:
        self.members.append((old, changed))

    async def on_signal(self, peer: str, kind: str, data: dict[str, Any]) -> None:
        self.signals.append((peer, kind, data))


def client(rec: Recorder, room: str | None = "lab-42") -> SignalingClient:
    return SignalingClient("https://signal.example:8787", room=room, name="n", approve=None,
                           join_timeout=1.0, on_members=rec.on_members,
                           on_signal=rec.on_signal)


async def test_handles_parsed_server_messages():
    rec = Recorder()
    c = client(rec)
    await c._handle({"type": "welcome", "id": "0a", "group": "g", "host": None,
                     "state": "waiting"})
    assert (c.self_id, c.group, c.host) == ("0a", "g", None)
    peers = [{"id": "01", "name": "h"}, {"id": "0a", "name": "n"}]
    await c._handle({"type": "peers", "peers": peers, "host": "01"})
    await c._handle({"type": "peers", "peers": peers, "host": "01"})  # no change
    assert c.members == ("01", "0a") and c.host == "01"
    assert rec.members == [((), True), (("01", "0a"), False)]
    await c._handle({"type": "signal", "from": "01", "kind": "offer", "data": {"sdp": "x"}})
    assert rec.signals == [("01", "offer", {"sdp": "x"})]
    assert c.host_link() is None
    await c._handle({"type": "host_key", "key": "s3cret"})
    assert c.host_link() == "https://signal.example:8787/?room=lab-42&key=s3cret"
    await c._handle({"type": "from-the-future"})  # ignored
    with pytest.raises(ValueError):  # protocol.ProtocolError: the reader logs and goes on
        await c._handle({"type": "peers"})


async def test_no_host_link_without_a_room():
    c = client(Recorder(), room=None)
    await c._handle({"type": "host_key", "key": "k"})
    assert c.host_link() is None


async def test_member_link_from_welcome_or_approval():
    c = client(Recorder())
    await c._handle({"type": "welcome", "id": "0a", "group": None, "host": None,
                     "state": "waiting"})
    assert c.member_link() is None  # a waiting peer has no view of the room
    await c._handle({"type": "approved", "group": "g", "member_key": "m3mber"})
    assert c.member_link() == "https://signal.example:8787/?room=lab-42&member=m3mber"
    c2 = client(Recorder())
    await c2._handle({"type": "welcome", "id": "0b", "group": "g", "host": "0b",
                      "state": "member", "member_key": "first"})
    assert c2.member_link() == "https://signal.example:8787/?room=lab-42&member=first"
