"""daisyweb-peer flags, test switches and helpers (no network)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from daisyweb.cli import peer
from daisyweb.peer import approve, data_url, options_from_args

S = ["--server", "http://127.0.0.1:9"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--server"),
        (["--server", "ftp://x"], "http"),
        (["--server", "127.0.0.1:8787"], "http"),
        (["--server", "http://h:99999"], "bad port"),
        ([*S, "--room", "ab"], "--room"),
        ([*S, "--room", "bad code!"], "--room"),
        ([*S, "--approve", "maybe"], "invalid choice"),
        ([*S, "--width", "64"], "needs --start"),
        ([*S, "--compute", "float"], "needs --start"),
        ([*S, "--start", "--compute", "fp16"], "invalid choice"),
        ([*S, "--resume", "x.pt"], "needs --start"),
        ([*S, "--start", "--width", "0"], "positive integer"),
        ([*S, "--start", "--width", "abc"], "positive integer"),
        ([*S, "--start", "--lr", "nan"], "positive number"),
        ([*S, "--start", "--lr", "-1"], "positive number"),
        ([*S, "--start", "--lr", "50"], "up to 10"),
        ([*S, "--start", "--steps", "0"], "positive integer"),
        ([*S, "--start", "--batch", "2147483649"], "positive integer"),
        ([*S, "--start", "--width", "30", "--heads", "4"], "not divisible"),
        ([*S, "--start", "--seed", "-2"], ">= 0"),
        ([*S, "--start", "--sync-every", "8", "--sync-max", "8", "--overlap", "9"],
         "at most --sync-max 8"),
        ([*S, "--start", "--sync-every", "8", "--overlap", "33"], "at most --sync-max 32"),
        ([*S, "--start", "--sync-every", "8", "--sync-max", "7"], "at least --sync-every 8"),
        ([*S, "--start", "--sync-every", "1", "--sync-max", "2"], "1 in lockstep"),
        ([*S, "--sync-max", "32"], "needs --start"),
        ([*S, "--task", "daisyweb.tasks.teacher:Teacher"], "needs --start"),
        ([*S, "--start", "--task-set", "hidden=8"], "--task-set needs --task"),
        ([*S, "--start", "--task", "a:B", "--task-set", "hidden"], "NAME=VALUE"),
        ([*S, "--start", "--task", "a:B", "--task-set", "noise=nan"], "finite number"),
        ([*S, "--start", "--task", "a:B", "--save", "x.pt"], "not a --task run's"),
        ([*S, "--start", "--sync-every", "1", "--overlap", "1"], "0 in lockstep"),
        ([*S, "--save-every", "5"], "needs --save"),
        ([*S, "--join-timeout", "0"], "positive number"),
        ([*S, "--wait-peers", "3"], "needs --start"),
        ([*S, "--bogus"], "unrecognized"),
        ([*S, "--transport", "quic"], "invalid choice"),
        ([*S, "--stun", "turn:h:3478"], "--stun: expected a URL like stun:"),
        ([*S, "--turn", "stun:h"], "--turn: expected a URL like turn:"),
        ([*S, "--turn", "turn:h:3478"], "needs --turn-user and --turn-credential"),
        ([*S, "--turn", "turn:h:3478", "--turn-user", "u"], "needs --turn-user"),
        ([*S, "--turn-user", "u"], "need --turn"),
        ([*S, "--relay"], "--relay needs --turn"),
        ([*S, "--ice-host", "localhost"], "--ice-host must be an IP address"),
    ],
)
def test_bad_flags_one_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        peer.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("daisyweb-peer: error:")
    assert needle in err


def test_transport_and_turn_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DAISYWEB_TRANSPORT", raising=False)
    monkeypatch.setenv("DAISYWEB_TURN_CREDENTIAL", "s3cret")
    a = peer.parse_args([*S, "--turn", "turn:127.0.0.1:3478", "--turn-user", "u", "--relay"])
    opts = options_from_args(a)
    assert opts.transport == "auto"  # the default: libwebrtc when wrtc imports
    assert (opts.turn, opts.turn_user, opts.turn_credential, opts.relay) == (
        ["turn:127.0.0.1:3478"], "u", "s3cret", True)
    monkeypatch.setenv("DAISYWEB_TRANSPORT", "aiortc")
    assert peer.parse_args(S).transport == "aiortc"
    assert peer.parse_args([*S, "--transport", "libwebrtc"]).transport == "libwebrtc"


def test_good_flags() -> None:
    a = peer.parse_args([*S, "--start", "--width", "16", "--heads", "2", "--stun",
                         "stun:a", "--stun", "stun:b", "--ice-host", "127.0.0.1"])
    assert (a.width, a.heads, a.layers) == (16, 2, peer.DEFAULTS["layers"])
    assert a.stun == ["stun:a", "stun:b"] and a.ice_host == ["127.0.0.1"]
    opts = options_from_args(a)
    assert opts.model == {"width": 16, "layers": peer.DEFAULTS["layers"], "heads": 2, "seq": 64}
    whole = peer.parse_args([*S, "--start", "--sync-every", "8", "--overlap", "8"])
    assert (whole.sync_every, whole.sync_max, whole.overlap) == (8, 32, 8)
    paced = peer.parse_args([*S, "--start", "--sync-every", "8"])
    assert (paced.sync_max, paced.overlap) == (32, 32)  # up to the longest round, whole
    fixed = peer.parse_args([*S, "--start", "--sync-every", "8", "--sync-max", "8"])
    assert (fixed.sync_max, fixed.overlap) == (8, 8)
    assert options_from_args(fixed).sync_max == 8
    task = peer.parse_args([*S, "--start", "--task", "daisyweb.tasks.teacher:Teacher",
                            "--task-set", "hidden=8", "--task-set", "noise=0.5"])
    got = options_from_args(task)
    assert (got.task, got.task_config) == ("daisyweb.tasks.teacher:Teacher",
                                           {"hidden": 8, "noise": 0.5})
    f = peer.parse_args([*S, "--room", "abcd", "--name", "x"])
    assert not f.start and f.width is None and options_from_args(f).model is None


def test_bad_flag_from_the_command_line_has_no_traceback() -> None:
    p = subprocess.run([sys.executable, "-m", "daisyweb.cli.peer", *S, "--steps", "x"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("http://127.0.0.1:8787", "http://127.0.0.1:8787/data"),
        ("ws://127.0.0.1:8787/ws", "http://127.0.0.1:8787/data"),
        ("wss://example.invalid/ws?x=1", "https://example.invalid/data"),
    ],
)
def test_data_url(server: str, url: str) -> None:
    assert data_url(server) == url


@pytest.mark.parametrize("content", [None, b"not a checkpoint", b"PK\x03\x04" + b"\x00" * 64])
def test_bad_resume_file_is_refused_before_connecting(tmp_path, content: bytes | None) -> None:
    path = tmp_path / "bad.pt"
    if content is not None:
        path.write_bytes(content)
    # Port 9 (discard) has no server: the refusal must come before any connection.
    p = subprocess.run([sys.executable, "-m", "daisyweb.cli.peer", *S, "--start",
                        "--resume", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("daisyweb-peer: --resume")
    assert "Traceback" not in p.stderr


def test_approve_ask_prompts_per_waiting_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    class Tty:
        def isatty(self) -> bool:
            return True

    answers = iter(["y", "n", "YES"])
    prompts: list[str] = []

    def fake_input(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr(sys, "stdin", Tty())
    monkeypatch.setattr("builtins.input", fake_input)
    ask = approve.approve_callback("ask", lambda: None)
    assert ask is not None

    async def decide() -> list[bool]:
        return [await ask("id1", "alice"), await ask("id2", "bob"), await ask("id3", "")]

    assert asyncio.run(decide()) == [True, False, True]
    assert "alice" in prompts[0] and "bob" in prompts[1]
    # auto: the mesh admits everyone with the code
    assert approve.approve_callback("auto", lambda: None) is None


def test_save_into_a_missing_directory_is_refused_before_connecting(tmp_path) -> None:
    target = tmp_path / "no" / "such" / "x.pt"
    p = subprocess.run([sys.executable, "-m", "daisyweb.cli.peer", *S, "--save", str(target)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--save: directory" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_save_under_a_file_is_refused_before_connecting(tmp_path) -> None:
    # Tests may run as root, where chmod does not stop writes; a file as parent always does.
    (tmp_path / "plain").write_text("not a directory")
    target = tmp_path / "plain" / "x.pt"
    p = subprocess.run([sys.executable, "-m", "daisyweb.cli.peer", *S, "--save", str(target)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == (
        f"daisyweb-peer: --save: {tmp_path / 'plain'} is not a directory")


def test_unopenable_metrics_file_is_one_line_exit_2(tmp_path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    bad = tmp_path / "plain" / "m.jsonl"
    p = subprocess.run([sys.executable, "-m", "daisyweb.cli.peer", *S, "--start",
                        "--metrics", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == f"daisyweb-peer: --metrics: cannot open {bad}: Not a directory"


def test_capacity_flag_is_the_leaders(capsys: pytest.CaptureFixture[str]) -> None:
    from daisyweb.cli.peer import parse_args
    from daisyweb.peer import options_from_args

    assert options_from_args(parse_args([*S, "--start"])).capacity is True  # default on
    assert options_from_args(parse_args([*S, "--start", "--capacity", "off"])).capacity is False
    for argv, says in (([*S, "--capacity", "on"], "--capacity needs --start"),
                       ([*S, "--start", "--capacity", "maybe"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1


