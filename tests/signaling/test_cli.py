import pytest

from signaling.cli import main
from signaling.server import FINEWEB


@pytest.mark.parametrize(
    "argv", [["--port", "abc"], ["--bogus"], ["--data", "nope"], ["--port", "0"]]
)
def test_bad_flags_one_line_nonzero(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("daisyweb-signal: error:") and "\n" not in err


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/", "127.0.0.1:8080", "http://", "http://127.0.0.1/?x=1", ""]
)
def test_bad_hf_endpoint_one_line_nonzero(url, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hf-endpoint", url])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("daisyweb-signal: error: --hf-endpoint") and "\n" not in err


def test_default_data_is_fineweb_against_the_hub(monkeypatch):
    from signaling.cli import build_app, parse_args
    from signaling.fineweb import FineWebReader

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    args = parse_args([])
    assert args.data == "hub" and args.hf_endpoint is None
    reader = build_app(args)[FINEWEB]
    assert isinstance(reader, FineWebReader)  # built, but nothing fetched until /data
    assert reader.endpoint == "https://huggingface.co" and reader.fetches == 0
    assert reader.dataset.repo == "HuggingFaceFW/fineweb-edu"
    assert reader.dataset.config == "sample-10BT"
    assert reader.describe()["shards"] is None  # listed by the first /data (or at start)
    assert parse_args(["--data", "fineweb"]).data == "fineweb"  # the old name still works


def test_hf_endpoint_flag_and_builtin(monkeypatch):
    from signaling.cli import build_app, parse_args

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    app = build_app(parse_args(["--hf-endpoint", "http://127.0.0.1:9/mirror/"]))
    assert app[FINEWEB].endpoint == "http://127.0.0.1:9/mirror"  # the flag wins over env
    assert build_app(parse_args(["--data", "builtin"]))[FINEWEB] is None


def test_port_in_use_is_one_line_exit_1(capsys) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["--host", "127.0.0.1", "--port", str(port), "--data", "builtin"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"daisyweb-signal: port {port} on 127.0.0.1 is in use; "
                   "pick another with --port")


def test_port_in_use_from_the_command_line_has_no_traceback() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "signaling.cli", "--port", str(port), "--data", "builtin"],
            capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"daisyweb-signal: port {port} on 127.0.0.1 is in use; pick another with --port")
