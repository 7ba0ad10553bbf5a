import aioice.ice
import pytest
from aiortc import RTCPeerConnection

from daisyweb.net import ice
from daisyweb.net import transport_aiortc as ice_aiortc


@pytest.fixture
def restricted():
    ice_aiortc.restrict_host_candidates(["127.0.0.1"])
    yield
    ice_aiortc.unrestrict()


def test_restrict_idempotent_and_env(monkeypatch):
    try:
        ice_aiortc.restrict_host_candidates(["127.0.0.1"])
        ice_aiortc.restrict_host_candidates(["127.0.0.1"])
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1"]
        monkeypatch.setenv(ice.ENV_VAR, "127.0.0.1, ::1")
        assert ice_aiortc.restrict_host_candidates() == ["127.0.0.1", "::1"]
        assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
        monkeypatch.delenv(ice.ENV_VAR)
        with pytest.raises(ValueError):
            ice_aiortc.restrict_host_candidates()
        with pytest.raises(ValueError):
            ice_aiortc.restrict_host_candidates(["not-an-ip"])
    finally:
        ice_aiortc.unrestrict()
    assert aioice.ice.get_host_addresses is ice_aiortc._original


async def test_offer_has_only_loopback_candidates(restricted):
    pc = RTCPeerConnection(ice_aiortc.rtc_configuration())
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
