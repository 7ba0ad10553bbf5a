import json

import pytest

from daisyweb.checkpoints.checkpoint import load_checkpoint
from daisyweb.cli import demo, generate
from daisyweb.training.config import DEFAULTS

TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2"]


def test_demo_single_peer_trains_saves_and_generate_reads_it(tmp_path, capsys) -> None:
    save, metrics = tmp_path / "demo.pt", tmp_path / "m.jsonl"
    code = demo.main(["--peers", "1", "--steps", "4", "--save", str(save),
                      "--metrics", str(metrics), *TINY])
    assert code == 0
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == [1, 2, 3, 4]
    ckpt = load_checkpoint(save)
    assert ckpt.step == 4 and ckpt.weight_hash == records[-1]["weight_hash"]
    capsys.readouterr()

    assert generate.main([str(save), "--prompt", "The ", "--tokens", "12", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ") and len(first) > len("The \n")
    generate.main([str(save), "--prompt", "The ", "--tokens", "12", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded sampling is reproducible


@pytest.mark.parametrize("compute", ["int8", "float"])
def test_generate_samples_through_the_forward_the_run_trained_with(
        tmp_path, capsys, monkeypatch, compute: str) -> None:
    save = tmp_path / "demo.pt"
    assert demo.main(["--peers", "1", "--steps", "2", "--save", str(save),
                      "--compute", compute, *TINY]) == 0
    assert load_checkpoint(save).run["compute"] == compute
    seen = []
    real = generate.forward

    def spy(*a, **kw):
        seen.append(kw.get("quantized", True))
        return real(*a, **kw)

    monkeypatch.setattr(generate, "forward", spy)
    assert generate.main([str(save), "--tokens", "2"]) == 0
    assert seen == [compute == "int8"] * 2


@pytest.mark.parametrize("argv", [["--peers", "0"], ["--steps", "0"], ["--width", "15"],
                                  ["--save-every", "5"], ["--peers", "x"]])
def test_demo_bad_flags_exit_2_with_message(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert "daisyweb-demo: error:" in capsys.readouterr().err


def test_generate_refuses_missing_and_bad_files(tmp_path, capsys) -> None:
    assert generate.main([str(tmp_path / "nope.pt")]) == 1
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert generate.main([str(bad)]) == 1
    assert "cannot use" in capsys.readouterr().err


def test_demo_group_of_three_ends_with_one_weight_hash(tmp_path) -> None:
    import re
    import subprocess
    import sys

    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "daisyweb.cli.demo", "--peers", "3", "--steps", "3",
         "--sync-every", "2", "--port", "0", "--metrics", str(metrics), *TINY],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the printed dashboard URL is the host's link: it carries the room's secret key
    assert re.search(r"daisyweb-demo: dashboard http://127\.0\.0\.1:\d+/\?room=demo-\w+&key=\S+",
                     proc.stdout), proc.stdout[-2000:]
    finals = re.findall(r"\[peer-(\d)\] daisyweb-peer: done at step 3, weight hash (\w+)",
                        proc.stdout)
    assert sorted(p for p, _ in finals) == ["0", "1", "2"]
    assert len({h for _, h in finals}) == 1
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    # rounds of 2 local steps (the last one short): one record per round
    assert [(r["round"], r["step"]) for r in records[:-1]] == [(1, 2), (2, 3)]
    # the leader may lengthen rounds up to 4x (--sync-max); 3 steps leave it no room
    assert {r["mode"] for r in records[:-1]} == {f"rounds H=2-8 {DEFAULTS['codec']}"}
    assert [r["round_steps"] for r in records[:-1]] == [2, 1]
    assert len(records[0]["roster"]) == 3
    assert records[-2]["weight_hash"].startswith(finals[0][1])
    # the demo evaluates by default (every 48 steps and the last): a held-out curve
    assert ["heldout_loss" in r for r in records[:-1]] == [False, True]


class _Health:
    """A tiny HTTP server on 127.0.0.1 answering /healthz with a chosen body."""

    def __init__(self, body: bytes) -> None:
        import http.server
        import threading

        outer_body = body

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(outer_body)

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _sleeper():
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


def test_demo_port_held_by_a_plain_socket_is_refused_at_once(capsys) -> None:
    import socket
    import time

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        code = demo.main(["--peers", "2", "--steps", "1", "--port", str(port), *TINY])
        took = time.monotonic() - t0
    assert code == 1 and took < 5
    err = capsys.readouterr().err
    assert f"daisyweb-demo: port {port} is in use; try --port 0" in err


def test_readiness_needs_our_healthz_not_just_a_listener() -> None:
    import socket

    proc = _sleeper()
    try:
        with socket.socket() as held:  # accepts TCP, never answers HTTP
            held.bind(("127.0.0.1", 0))
            held.listen()
            assert not demo._wait_http(held.getsockname()[1], proc, timeout=1.0)
        for body, ok in [(b'{"ok": true, "peers": 0}', True), (b'{"ok": false}', False),
                         (b"<html>hello</html>", False), (b'["ok"]', False)]:
            h = _Health(body)
            try:
                assert demo._wait_http(h.port, proc, timeout=0.4) is ok, body
            finally:
                h.close()
    finally:
        proc.kill()
        proc.wait()


def test_readiness_fails_when_the_server_process_died() -> None:
    proc = _sleeper()
    proc.kill()
    proc.wait()
    h = _Health(b'{"ok": true}')  # something healthy answers, but our server is gone
    try:
        assert not demo._wait_http(h.port, proc, timeout=1.5)
    finally:
        h.close()


def _patch_loss(monkeypatch, at: int, effect) -> None:
    """Make the model's loss_and_grad misbehave on its ``at``-th call (= step ``at``)."""
    import daisyweb.tasks.gpt as state  # the built-in GPT task's forward and backward

    real = state.loss_and_grad
    calls = [0]

    def patched(model, params, batch, **kw):
        calls[0] += 1
        loss, grad = real(model, params, batch, **kw)
        if calls[0] == at:
            return effect(loss, grad)
        return loss, grad

    monkeypatch.setattr(state, "loss_and_grad", patched)


def _nan_grad(loss, grad):
    grad = grad.copy()
    grad[:3] = float("nan")
    return loss, grad


def _raise(loss, grad):
    from kernels import NonFiniteError

    raise NonFiniteError("activation has 1 NaN/Inf values")


@pytest.mark.parametrize("effect,why", [
    (_nan_grad, "GradientError: gradient: 3 NaN/Inf values"),
    (_raise, "NonFiniteError: activation has 1 NaN/Inf values"),
])
def test_demo_single_peer_halt_is_one_line_and_keeps_the_last_step(
        tmp_path, capsys, monkeypatch, effect, why) -> None:
    save, metrics = tmp_path / "demo.pt", tmp_path / "m.jsonl"
    _patch_loss(monkeypatch, 3, effect)
    code = demo.main(["--peers", "1", "--steps", "6", "--save", str(save),
                      "--metrics", str(metrics), *TINY])
    assert code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"daisyweb-demo: training halted at step 3: {why}; "
        f"the last committed step (2) is saved to {save}")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == [1, 2]
    assert records[-1]["end"].startswith("error:") and records[-1]["step"] == 2
    ckpt = load_checkpoint(save)
    assert ckpt.step == 2 and ckpt.weight_hash == records[-1]["weight_hash"]


def test_demo_single_peer_save_dir_removed_mid_run(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    save = out / "demo.pt"

    def remove_dir(loss, grad):
        save.unlink()
        out.rmdir()
        return loss, grad

    _patch_loss(monkeypatch, 3, remove_dir)  # step 2 saved; steps 3 and 4 cannot be
    code = demo.main(["--peers", "1", "--steps", "4", "--save", str(save),
                      "--save-every", "1", *TINY])
    assert code == 1  # the final checkpoint is lost: the run must not say "done"
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and "daisyweb-demo: done" not in cap.out
    lines = [x for x in cap.err.splitlines() if x.startswith("daisyweb-demo:")]
    assert lines[0].startswith("daisyweb-demo: could not save a periodic checkpoint "
                               "(training goes on) of step 3: ")
    assert lines[-1].startswith("daisyweb-demo: could not save the final checkpoint "
                                "of step 4: ")
    assert "kernels: backend" in cap.out  # training itself reached the end


def test_demo_single_peer_end_record_carries_kernel_counts(tmp_path, capsys) -> None:
    import kernels

    metrics = tmp_path / "m.jsonl"
    assert demo.main(["--peers", "1", "--steps", "2", "--metrics", str(metrics), *TINY]) == 0
    end = json.loads(metrics.read_text().splitlines()[-1])
    k = end["kernels"]
    assert k["backend"] == kernels.active_backend()
    assert k["macs"][k["backend"]] > 0 and isinstance(k["demotions"], list)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "kernels: backend" in x)
    assert f"kernels: backend {k['backend']}, demotions: " in line
    assert f"{k['backend']} {k['macs'][k['backend']]:,}" in line


def test_port_with_only_time_wait_connections_is_free() -> None:
    import socket

    # A previous run's server closed its connections first: they sit in TIME_WAIT on
    # the port. Our server can bind (SO_REUSEADDR), so the check must not cry "in use".
    with socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's listener
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = lst.accept()
        conn.close()  # server side closes first -> TIME_WAIT on 127.0.0.1:port
        client.recv(1)
        client.close()
    assert not demo._port_in_use(port)
    with socket.socket() as live:
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        live.bind(("127.0.0.1", port))
        live.listen()
        assert demo._port_in_use(port)


def test_demo_unopenable_metrics_file_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "plain").write_text("not a directory")
    bad = tmp_path / "plain" / "m.jsonl"
    assert demo.main(["--peers", "1", "--steps", "1", "--metrics", str(bad), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"daisyweb-demo: --metrics: cannot open {bad}: Not a directory"


def test_demo_peers_share_the_cores_one_blas_thread_each(monkeypatch) -> None:
    from daisyweb.cli.demo import blas_threads

    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert blas_threads(3, cores=2) == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                                        "MKL_NUM_THREADS": "1"}
    assert blas_threads(2, cores=8)["OPENBLAS_NUM_THREADS"] == "4"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # the user's choice is kept
    assert "OPENBLAS_NUM_THREADS" not in blas_threads(3, cores=2)


def test_demo_passes_capacity_to_its_leader() -> None:
    from daisyweb.training.config import run_config

    parser = demo._parser()
    run = run_config(64)
    for flag in ("on", "off"):
        args = parser.parse_args(["--capacity", flag])
        leader, follower = demo.peer_commands(args, run, "http://127.0.0.1:9", "room1")[:2]
        assert leader[leader.index("--capacity") + 1] == flag
        assert "--capacity" not in follower  # the leader's call
    assert parser.parse_args([]).capacity == "on"


def test_demo_passes_transport_to_every_peer_only_when_asked() -> None:
    from daisyweb.training.config import run_config

    run = run_config(2048)
    for given, want in ((None, None), ("libwebrtc", "libwebrtc"), ("aiortc", "aiortc")):
        args = demo._parser().parse_args(["--peers", "3"]
                                         + (["--transport", given] if given else []))
        cmds = demo.peer_commands(args, run, "http://127.0.0.1:9", "demo-x")
        for cmd in cmds:
            if want is None:  # each peer's own default: auto, or $DAISYWEB_TRANSPORT
                assert "--transport" not in cmd
            else:
                assert cmd[cmd.index("--transport") + 1] == want


def test_demo_trains_a_task_alone(tmp_path, capsys) -> None:
    metrics = tmp_path / "m.jsonl"
    code = demo.main(["--peers", "1", "--steps", "20", "--lr", "0.02", "--task",
                      "daisyweb.tasks.teacher:Teacher", "--task-set", "hidden=8",
                      "--metrics", str(metrics)])
    assert code == 0
    assert "task daisyweb.tasks.teacher:Teacher" in capsys.readouterr().out
    losses = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()[:-1]]
    assert len(losses) == 20 and sum(losses[-5:]) < 0.5 * sum(losses[:5])


@pytest.mark.parametrize("flags,why", [
    (["--task-set", "hidden=8"], "--task-set needs --task"),
    (["--task", "daisyweb.tasks.teacher:Teacher", "--save", "x.pt"], "not a --task run's"),
    (["--task", "daisyweb.tasks.teacher:Teacher", "--task-set", "width=8"],
     "no setting 'width'"),
    (["--task", "nosuchmodule:Task"], "cannot import nosuchmodule"),
])
def test_demo_task_flags_are_checked(capsys, flags, why) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--peers", "1", *flags])
    assert exc.value.code == 2 and why in capsys.readouterr().err
