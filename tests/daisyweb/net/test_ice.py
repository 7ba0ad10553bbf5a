import aioice.ice
import pytest
from aiortc import RTCPeerConnection

from daisyweb.net import ice


@pytest.fixture
def restricted():
    ice.restrict_host_candidates(["127.0.0.1"])
    yield
    ice.unrestrict()


def test_restrict_idempotent_and_env(monkeypatch):
    try:
        ice.restrict_host_candidates(["127.0.0.1"])
        ice.restrict_host_candidates(["127.0.0.1"])
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1"]
        monkeypatch.setenv(ice.ENV_VAR, "127.0.0.1, ::1")
        assert ice.restrict_host_candidates() == ["127.0.0.1", "::1"]
        assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
        monkeypatch.delenv(ice.ENV_VAR)
        with pytest.raises(ValueError):
            ice.restrict_host_candidates()
        with pytest.raises(ValueError):
            ice.restrict_host_candidates(["not-an-ip"])
    finally:
        ice.unrestrict()
    assert aioice.ice.get_host_addresses is ice._original


async def test_offer_has_only_loopback_candidates(restricted):
    pc = RTCPeerConnection(ice.rtc_configuration())
    try:
        pc.createDataChannel("x")
        await pc.setLocalDescription(await pc.createOffer())
        lines = [ln for ln in pc.localDescription.sdp.splitlines() if ln.startswith("a=candidate")]
        assert lines
        for ln in lines:
            assert ln.split()[4] == "127.0.0.1", ln
            assert " typ host" in ln
    finally:
        await pc.close()


def test_the_suite_runs_with_ice_restricted_to_loopback() -> None:
    # tests/conftest.py sets it for every test and every peer subprocess.
    import os

    assert os.environ.get("DAISYWEB_ICE_HOSTS") == "127.0.0.1"
