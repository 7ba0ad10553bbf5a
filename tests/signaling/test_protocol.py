"""Tests for signaling.protocol's client side: what a client builds passes the server's
decoder, and what the server sends parses into its dataclass."""

from __future__ import annotations

import json

import pytest

from signaling import protocol


def test_client_messages_pass_the_server_decoder():
    sig = protocol.signal("0a", "offer", {"sdp": "v=0", "type": "offer", "session": 3})
    assert protocol.decode(json.dumps(sig)) == sig
    assert protocol.decode(json.dumps(protocol.decision("0b", True))) == {
        "type": "approve", "id": "0b"}
    assert protocol.decode(json.dumps(protocol.decision("0b", False))) == {
        "type": "deny", "id": "0b"}
    for mode in ("ask", "auto"):
        assert protocol.decode(json.dumps(protocol.policy(mode))) == {
            "type": "policy", "approve": mode}
    fields = {"step": 3, "loss": 1.5, "hash": "ab", "peers": 2, "state": "training"}
    st = protocol.status(fields)
    assert st == {"type": "status", **fields}
    assert protocol.decode(json.dumps(st)) == st


def test_parse_server_messages():
    p = protocol.parse_server
    assert p({"type": "welcome", "id": "0a", "group": "g", "host": None,
              "state": "member"}) == protocol.Welcome("0a", "g", None, True)
    assert p({"type": "welcome", "id": "0a", "state": "waiting"}).member is False
    assert p({"type": "peers", "peers": [{"id": "01", "name": "x"}, {"id": "02"}],
              "host": "01"}) == protocol.PeerList((("01", "x"), ("02", "")), "01")
    assert p({"type": "waiting", "peers": []}) == protocol.Waiting(())
    assert p({"type": "approved"}) == protocol.Approved()
    assert p({"type": "denied"}) == protocol.Denied()
    assert p({"type": "signal", "from": "01", "kind": "answer", "data": {"sdp": "s"}}) == (
        protocol.Relayed("01", "answer", {"sdp": "s"}))
    assert p({"type": "host_key", "key": "k"}) == protocol.HostKey("k")
    assert p({"type": "decision", "id": "02", "approve": True}) == protocol.Decision("02", True)
    assert p({"type": "policy", "approve": "auto"}) == protocol.Policy("auto")
    assert p({"type": "error", "code": "bad_field", "message": "m"}) == (
        protocol.Refused("bad_field", "m"))
    assert p({"type": "new-thing"}) == protocol.UnknownMessage("new-thing")


@pytest.mark.parametrize("msg", [
    {"type": "welcome"},
    {"type": "peers"},
    {"type": "peers", "peers": "nope"},
    {"type": "peers", "peers": [{"name": "no id"}]},
    {"type": "signal", "from": "01", "kind": "offer"},
    {"type": "signal", "from": "01", "kind": "offer", "data": "not an object"},
    {"type": "host_key"},
    {"type": "decision", "id": "01"},
    {"type": "policy"},
    {"type": "policy", "approve": "sometimes"},
    {"type": "policy", "approve": True},
])
def test_parse_server_refuses_incomplete(msg: dict):
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_server(msg)


@pytest.mark.parametrize(("msg", "code"), [
    ({"type": "policy"}, "missing_field"),
    ({"type": "policy", "approve": "maybe"}, "bad_field"),
    ({"type": "policy", "approve": ["auto"]}, "bad_field"),
    ({"type": "policy", "approve": None}, "bad_field"),
])
def test_policy_refused_unless_ask_or_auto(msg: dict, code: str):
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.decode(json.dumps(msg))
    assert exc.value.code == code
