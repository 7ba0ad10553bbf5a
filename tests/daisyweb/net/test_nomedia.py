"""daisyweb.net.nomedia: aiortc and webrtc.aiortc load without PyAV.

Each case runs in a fresh interpreter: the test process itself may have loaded PyAV
already (anything that imported aiortc first), and then the stand-in stays out.
"""

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_choosing_aiortc_leaves_pyav_unloaded() -> None:
    out = _run("""
        import sys
        from daisyweb.net import nomedia, transport
        transport.choose("aiortc")
        import aiortc
        av = sys.modules["av"]
        print(isinstance(av, nomedia._StandIn), getattr(av, "__file__", None))
        print(sorted(m for m in sys.modules if m.startswith("av.")))
        print(any("/av/" in line or "libavcodec" in line
                  for line in open("/proc/self/maps")))
    """)
    stand_in, submodules, mapped = out.splitlines()
    assert stand_in == "True None"
    assert "'av.frame'" in submodules and "'av.packet'" in submodules  # aiortc asked for them
    assert mapped == "False"  # no PyAV extension and no FFmpeg library in the process


def test_a_media_object_is_refused_with_one_clear_error() -> None:
    out = _run("""
        from daisyweb.net import nomedia, transport
        transport.choose("aiortc")
        from av import AudioFrame
        from av.frame import Frame
        import av
        assert av.AudioFrame is AudioFrame  # the same class wherever it is imported from
        for cls in (AudioFrame, Frame):
            try:
                cls(format="s16", samples=960)
            except nomedia.MediaUnavailable as e:
                print(e)
    """)
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("av.AudioFrame is not available: daisyweb loads WebRTC for "
                               "data channels only")
    assert lines[1].startswith("av.frame.Frame is not available")


def test_a_process_that_loaded_pyav_keeps_it() -> None:
    out = _run("""
        import sys
        import av
        from daisyweb.net import nomedia
        print(nomedia.install(), nomedia.installed(), sys.modules["av"] is av)
        import aiortc
        print(type(sys.modules["av"]).__name__, hasattr(av, "__file__"))
    """)
    assert out.splitlines() == ["False False True", "module True"]


def test_install_is_idempotent_and_reports_itself() -> None:
    out = _run("""
        import sys
        from daisyweb.net import nomedia
        print(nomedia.installed(), nomedia.install(), nomedia.install(), nomedia.installed())
        print(sum(isinstance(f, nomedia._Finder) for f in sys.meta_path))
    """)
    assert out.splitlines() == ["False True True True", "1"]


def test_libwebrtc_api_module_loads_without_pyav() -> None:
    pytest.importorskip("webrtc")
    # Importing webrtc.aiortc opens no connection and gathers no candidate.
    out = _run("""
        import sys
        from daisyweb.net import nomedia
        nomedia.install()
        import webrtc.aiortc
        print(isinstance(sys.modules["av"], nomedia._StandIn))
    """)
    assert out.strip() == "True"
