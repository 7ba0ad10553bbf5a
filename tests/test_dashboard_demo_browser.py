"""The dashboard in headless Chromium against a REAL group: the peers are processes.

A real signaling server (``signaling.cli``'s app, run in this process so the test can read
the member key the server gave the joiner: the peer does not print a member link), a real
host peer (``--approve ask`` without a terminal, so the dashboard decides) and real
joiners over aiortc on 127.0.0.1. The host's printed link
is opened in Chromium; a click on Accept admits the joiner, the loss curve then moves with
real training and both peers show the same weight-hash prefix, which must match what the
peers themselves recorded. A member's page (no key) can watch but never approve, a forged
decision is refused with 403, and the host's page denies a third peer, which exits 3.
When the run ends and the room empties, the pages keep the last state seen and say why.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp import web
from playwright.async_api import Page, async_playwright

from signaling.cli import build_app, parse_args
from signaling.server import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
ROOM = "demo-dash"
STEPS = 40
MODEL = ["--width", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
         "--lr", "0.01", "--seed", "3", "--steps", str(STEPS),
         "--sync-every", "1", "--codec", "f32"]  # lockstep: a point on the curve every step
# Slows each real step so the curve can be watched moving and the third peer can knock
# while the group still trains (40 steps take >= 10 s).
SLOW = {"DAISYWEB_TEST_STEP_DELAY": "0.25"}
LINK_MARK = "dashboard with Accept/Deny (keep it private): "


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[str]
    log: Path
    metrics: Path

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    async def wait_for(self, needle: str, timeout: float = 30) -> str:
        """Wait until ``needle`` is in the log; return the log. Fails if the process ends."""
        deadline = time.monotonic() + timeout
        while needle not in (text := self.text()):
            assert self.proc.poll() is None, f"{self.name} exited early:\n{text}"
            assert time.monotonic() < deadline, f"{self.name}: no {needle!r}:\n{text}"
            await asyncio.sleep(0.05)
        return text

    async def exit_code(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.proc.poll()) is None:
            assert time.monotonic() < deadline, f"{self.name} hung:\n{self.text()}"
            await asyncio.sleep(0.05)
        return code

    def steps(self) -> dict[int, str]:
        """Committed step -> weight hash, from the peer's own --metrics records."""
        rows = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
        return {r["step"]: r["weight_hash"] for r in rows if "end" not in r}


def _spawn(procs: list[Proc], tmp: Path, name: str, args: list[str], server: str,
           env: dict[str, str] | None = None) -> Proc:
    log, metrics = tmp / f"{name}.log", tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "tests.fault_peer", "--server", server, "--room", ROOM,
           "--name", name, "--ice-host", "127.0.0.1", "--metrics", str(metrics),
           "--join-timeout", "40", *args]
    with open(log, "w") as out:
        # stdin is no terminal: the host's --approve ask waits for the dashboard
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    p = Proc(name, proc, log, metrics)
    procs.append(p)
    return p


async def _start_server() -> tuple[web.AppRunner, str]:
    """The app ``daisyweb-signal --data builtin`` runs, on a free port of 127.0.0.1."""
    runner = web.AppRunner(build_app(parse_args(["--data", "builtin"])))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _member_key(runner: web.AppRunner, peer_id: str) -> str:
    """The key the server gave member ``peer_id`` with its admission."""
    key = runner.app[REGISTRY].peers[peer_id][0].member_key
    assert key, peer_id
    return key


async def _post_decide(page: Page, body: dict) -> int:
    """A decision POSTed from ``page`` (same origin, like the page's own button)."""
    return await page.evaluate(
        """async ([room, body]) => (await fetch('/api/rooms/' + room + '/decide', {
             method: 'POST', headers: {'Content-Type': 'application/json'},
             body: JSON.stringify(body)})).status""",
        [ROOM, body],
    )


async def test_dashboard_drives_a_real_group(tmp_path: Path, chromium) -> None:
    t0 = time.monotonic()
    server, url = await _start_server()
    procs: list[Proc] = []
    try:
        host = _spawn(procs, tmp_path, "host",
                      ["--start", "--approve", "ask", "--wait-peers", "2", *MODEL], url, SLOW)
        link = (await host.wait_for(LINK_MARK)).split(LINK_MARK, 1)[1].split()[0]
        assert link.startswith(url + "/?"), link  # the host links to this server only
        key = parse_qs(urlsplit(link).query)["key"][0]
        async with async_playwright() as pw:
            ctx = await chromium(pw, {"width": 1100, "height": 1000})
            requests: list[str] = []
            ctx.on("request", lambda r: requests.append(r.url))
            errors: list[str] = []
            try:
                page = await ctx.new_page()
                page.on("pageerror", lambda e: errors.append(str(e)))
                await page.goto(link + "&poll=200")
                await page.wait_for_function(
                    "() => / \\(host view\\)$/.test(document.getElementById('title')"
                    ".textContent)", timeout=10000)

                # a real second peer knocks: the host's page lists it with Accept
                joiner = _spawn(procs, tmp_path, "joiner", [], url, SLOW)
                accept = page.locator(".waiting-row").filter(has_text="joiner").locator(
                    "button.accept")
                await accept.wait_for(timeout=20000)
                assert await page.locator(".waiting-row .name").all_text_contents() == [
                    "joiner"]
                await host.wait_for("joiner is waiting: accept or deny on the dashboard")
                shots = [tmp_path / "demo-waiting.png"]
                await page.screenshot(path=str(shots[-1]), full_page=True)
                await accept.click()
                joiner_id = (await joiner.wait_for("joined as ", 20)).split(
                    "joined as ", 1)[1].split()[0]
                host_id = host.text().split("joined as ", 1)[1].split()[0]

                # real training: the host's loss curve grows as steps commit
                line = page.locator(f"#loss-{host_id}")
                await line.wait_for(state="attached", timeout=20000)
                before = await line.get_attribute("points")
                count0 = int(await line.get_attribute("data-count") or 0)
                await page.wait_for_function(
                    "([id, old, n]) => { const l = document.getElementById('loss-' + id);"
                    " return l.getAttribute('points') !== old"
                    " && Number(l.dataset.count) >= n + 3; }",
                    arg=[host_id, before, count0], timeout=15000)
                after = await line.get_attribute("points")
                assert after != before and len(after.split()) >= len(before.split()) + 3
                await page.locator(f"#loss-{joiner_id}").wait_for(state="attached")

                # both peers listed, at one step with one weight-hash prefix
                seen = await page.wait_for_function(
                    """([a, b]) => {
                      const cell = (id, sel) => document.querySelector(
                        `#members tr[data-peer="${id}"] ${sel}`);
                      const ra = cell(a, 'td.hash'), rb = cell(b, 'td.hash');
                      if (!ra || !rb || ra.textContent === '–') return false;
                      const sa = cell(a, 'td:nth-child(4)').textContent;
                      const sb = cell(b, 'td:nth-child(4)').textContent;
                      if (sa !== sb || ra.textContent !== rb.textContent) return false;
                      const la = cell(a, 'td:nth-child(5)').textContent;
                      const lb = cell(b, 'td:nth-child(5)').textContent;
                      return [Number(sa), ra.textContent, ra.className, rb.className,
                              Number(la), Number(lb),
                              Number(document.getElementById('loss').textContent),
                              document.getElementById('step').textContent];
                    }""", arg=[host_id, joiner_id], timeout=15000)
                step, prefix, cls_a, cls_b, loss_a, loss_b, card, card_step = (
                    await seen.json_value())
                assert "diverged" not in cls_a + cls_b
                # each peer's loss is on its own batches; the card shows their mean
                assert card_step == str(step)
                assert card == pytest.approx((loss_a + loss_b) / 2, abs=1.5e-4)
                assert len(prefix) == 16
                assert await page.locator("#members tbody tr").count() == 2
                assert await page.text_content("#hash-summary") != "–"
                # the real peers' mode, round and comm share (no --eval-every: no held-out)
                assert await page.text_content("#mode") == "lockstep f32"
                assert int(await page.text_content("#round")) >= 1
                assert (await page.text_content("#comm-share")).endswith("%")
                assert await page.text_content("#heldout") == "–"
                shots.append(tmp_path / "demo-training.png")
                await page.screenshot(path=str(shots[-1]), full_page=True)

                # a member's id opens nothing; its member key (no host key) watches the
                # same room but cannot approve
                watcher = await ctx.new_page()
                watcher.on("pageerror", lambda e: errors.append(str(e)))
                await watcher.goto(f"{url}/?room={ROOM}&peer={joiner_id}&poll=200")
                await watcher.wait_for_selector("#error:not([hidden])", timeout=10000)
                assert await watcher.locator("#group").is_hidden()
                member = _member_key(server, joiner_id)
                await watcher.goto(f"{url}/?room={ROOM}&member={member}&poll=200")
                await watcher.wait_for_selector(f'#members tr[data-peer="{host_id}"]',
                                                timeout=10000)
                late = _spawn(procs, tmp_path, "late", [], url)
                late_row = page.locator(".waiting-row").filter(has_text="late")
                await late_row.locator("button.deny").wait_for(timeout=20000)
                late_id = await late_row.get_attribute("data-peer")
                await watcher.wait_for_function(
                    "() => /1 waiting/.test(document.getElementById('waiting').textContent)",
                    timeout=10000)
                assert await watcher.locator("button.accept").count() == 0
                assert "(host view)" not in await watcher.text_content("#title")
                assert "late" not in await watcher.text_content("#waiting")
                for forged in ({"id": late_id, "approve": True},
                               {"key": "forged-" + key[:8], "id": late_id, "approve": True}):
                    assert await _post_decide(watcher, forged) == 403
                shots.append(tmp_path / "demo-watcher.png")
                await watcher.screenshot(path=str(shots[-1]), full_page=True)
                await asyncio.sleep(0.5)
                assert late.proc.poll() is None and "joined as" not in late.text()

                # the host's page denies it: the real host refuses, the peer exits 3
                await late_row.locator("button.deny").click()
                assert await late.exit_code(20) == 3
                assert "denied" in late.text() and "joined as" not in late.text()

                # the run ends, both peers leave and the room empties: the host's page
                # keeps the last state it saw, says why, and offers nothing to decide
                assert await host.exit_code(30) == 0, host.text()
                assert await joiner.exit_code(30) == 0, joiner.text()
                await page.wait_for_function(
                    "() => /last state seen/.test(document.getElementById('error')"
                    ".textContent)", timeout=10000)
                assert await page.locator("#error").is_visible()
                assert await page.locator("#group").is_visible()
                assert await page.locator("#members tbody tr").count() == 2
                assert await page.locator("#waiting button").count() == 0
                assert int(await page.text_content("#step")) >= STEPS - 2
                await watcher.wait_for_function(
                    "() => /member whose key is in \\?member= has left/.test("
                    "document.getElementById('error').textContent)", timeout=10000)
                assert await watcher.locator("#members tbody tr").count() == 2
                shots.append(tmp_path / "demo-ended.png")
                await page.screenshot(path=str(shots[-1]), full_page=True)
                print("dashboard screenshots:", *map(str, shots))
            finally:
                await ctx.close()
            assert not errors, errors
            outside = [u for u in requests if not u.startswith(url + "/")]
            assert not outside, outside

        assert f"done at step {STEPS}" in host.text()
        # what the page showed is what the peers computed, and they agree at every step
        host_steps, joiner_steps = host.steps(), joiner.steps()
        assert host_steps[step][:16] == prefix
        common = host_steps.keys() & joiner_steps.keys()
        assert len(common) >= STEPS - 1
        assert all(host_steps[s] == joiner_steps[s] for s in common)
        print(f"real dashboard demo: {time.monotonic() - t0:.1f} s, page hash {prefix} "
              f"at step {step}")
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        await server.cleanup()
