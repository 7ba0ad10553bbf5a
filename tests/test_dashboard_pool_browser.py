"""The dashboard's pool view in headless Chromium (Debian's package) against a real
signaling server, with fake peers that are real WebSocket clients sending status reports
with the pool fields: machines, shares and speeds, the pooled cores and RAM, the ETA,
the link matrix and the held-out loss curve; and the health line naming the dataset.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from playwright.async_api import async_playwright

from signaling.fineweb import FineWebReader
from signaling.hubdata import DatasetSpec
from signaling.server import create_app, find_static_dir

ROOM = "pool-room"


async def recv(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 5.0) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), timeout)
        if msg["type"] == kind:
            return msg


def status(step: int, **extra: object) -> dict:
    return {"type": "status", "step": step, "loss": 3.0, "hash": "aaaa", "peers": 3,
            "state": "training", "comm_share": 0.2} | extra


async def test_pool_view_in_chromium(chromium) -> None:
    # A reader that names its dataset (nothing is fetched: /data is never asked here).
    reader = FineWebReader("http://127.0.0.1:9", files=["small/train-0.parquet"],
                           dataset=DatasetSpec("someone/essays", "small", "train", "body"))
    runner = web.AppRunner(create_app(data_source="hub", fineweb=reader))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    session = aiohttp.ClientSession()

    async def join(name: str) -> tuple[aiohttp.ClientWebSocketResponse, str]:
        ws = await session.ws_connect(url + "/ws", params={"room": ROOM, "name": name})
        return ws, (await recv(ws, "welcome"))["id"]

    try:
        alice, a = await join("alice")
        key = (await recv(alice, "host_key"))["key"]
        bob, b = await join("bob")
        await alice.send_json({"type": "approve", "id": b})
        await recv(bob, "approved")
        carol, c = await join("carol")
        await alice.send_json({"type": "approve", "id": c})
        await recv(carol, "approved")
        machine_a = {"machine": "0123456789abcdef",
                     "cpu": "Intel(R) Core(TM)2 Duo CPU E8400 @ 3.00GHz", "cores": 2,
                     "ram_mb": 4096, "backend": "blas64", "share": 0.625,
                     "peer_tokens_per_s": 812.4, "total_steps": 300, "transport": "aiortc"}
        # bob's CPU string is printable (the server takes it) but looks like markup
        machine_b = {"cpu": "<b>old</b> box", "cores": 4, "ram_mb": 8192, "backend": "blas",
                     "share": 0.375, "peer_tokens_per_s": 400.0, "total_steps": 300,
                     "transport": "libwebrtc"}
        await alice.send_json(status(10, **machine_a, eta_s=125, links={b: 1.2, c: None},
                                     heldout_loss=6.0, heldout_step=10))
        await bob.send_json(status(10, **machine_b, eta_s=130, links={a: 1.6}))
        await carol.send_json(status(10))  # an older peer: no pool fields at all

        async with async_playwright() as pw:
            ctx = await chromium(pw, {"width": 1200, "height": 1000})
            requests: list[str] = []
            errors: list[str] = []
            ctx.on("request", lambda r: requests.append(r.url))
            try:
                page = await ctx.new_page()
                page.on("pageerror", lambda e: errors.append(str(e)))
                await page.goto(f"{url}/?room={ROOM}&key={key}&poll=150")
                await page.wait_for_function(
                    "() => document.getElementById('pool-cores').textContent !== '–'",
                    timeout=10000)
                # pooled over the machines that said what they are
                assert await page.text_content("#pool-cores") == (
                    "6 on 2 machines (1 not reporting)")
                assert await page.text_content("#pool-ram") == "12.0 GiB (1 not reporting)"
                assert await page.text_content("#pool-eta") == "2m05s (to step 300)"
                health = await page.text_content("#health")
                assert health.endswith("Data: someone/essays (small, split train, "
                                       "column body).")

                row = await page.locator(f'#machines tr[data-peer="{a}"] td').all_text_contents()
                assert row == ["alice", machine_a["cpu"], "2", "4.0 GiB", "blas64", "aiortc",
                               "62.5%", "812", "20%"]
                row_b = await page.locator(f'#machines tr[data-peer="{b}"] td').all_text_contents()
                assert row_b[1] == "<b>old</b> box" and row_b[6] == "37.5%"
                assert row_b[5] == "libwebrtc"  # the transport each peer says it uses
                assert await page.locator("#machines b").count() == 0  # text, not markup
                row_c = await page.locator(f'#machines tr[data-peer="{c}"] td').all_text_contents()
                assert row_c == ["carol", "–", "–", "–", "–", "–", "–", "–", "20%"]
                # carol now reports: she runs on alice's machine, which counts once
                await carol.send_json(status(10, machine=machine_a["machine"], cores=1,
                                             ram_mb=4096))
                await page.wait_for_function(
                    "() => !document.getElementById('pool-cores').textContent"
                    ".includes('not reporting')", timeout=10000)
                assert await page.text_content("#pool-cores") == "6 on 2 machines"
                assert await page.text_content("#pool-ram") == "12.0 GiB"

                async def cell(frm: str, to: str) -> tuple[str, str]:
                    td = page.locator(f'#link-matrix tr[data-peer="{frm}"] td[data-to="{to}"]')
                    return await td.text_content(), await td.get_attribute("class")

                assert await cell(a, b) == ("1.2 ms", "up")
                assert await cell(a, c) == ("up", "up")  # connected, not measured yet
                assert await cell(b, a) == ("1.6 ms", "up")
                assert await cell(b, c) == ("no link", "down")
                assert await cell(c, a) == ("?", "unknown")  # carol says nothing of links
                assert await cell(a, a) == ("·", "self")

                # the held-out curve: one point per evaluation, growing as they come
                line = page.locator(f"#heldout-{a}")
                await line.wait_for(state="attached", timeout=10000)
                assert await line.get_attribute("data-count") == "1"
                assert await page.locator("#heldout-none").is_hidden()
                for step, loss in ((20, 5.5), (30, 5.25)):
                    await alice.send_json(status(step, **machine_a, eta_s=60, links={b: 2.0},
                                                 heldout_loss=loss, heldout_step=step))
                await page.wait_for_function(
                    f"() => document.getElementById('heldout-{a}')?.dataset.count === '3'",
                    timeout=10000)
                assert len((await line.get_attribute("points")).split()) == 3
                assert await page.text_content("#pool-eta") == "1m00s (to step 300)"
                assert await cell(a, b) == ("2.0 ms", "up")
                assert await cell(a, c) == ("no link", "down")  # its newest report: gone
                await page.screenshot(path="/tmp/daisyweb-pool-dashboard.png", full_page=True)
                # the run ends: ETA says so
                for ws in (alice, bob, carol):
                    await ws.send_json(status(300, state="done"))
                await page.wait_for_function(
                    "() => document.getElementById('pool-eta').textContent === 'done'",
                    timeout=10000)
            finally:
                await ctx.close()
        assert not errors, errors
        assert all(u.startswith(url) for u in requests)
    finally:
        await session.close()
        await runner.cleanup()


async def test_a_run_without_evaluations_says_so(chromium) -> None:
    runner = web.AppRunner(create_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    session = aiohttp.ClientSession()
    try:
        ws = await session.ws_connect(url + "/ws", params={"name": "solo"})
        gid = (await recv(ws, "welcome"))["group"]
        await ws.send_json(status(5, cores=8, ram_mb=512, eta_s=4000, total_steps=50))
        async with async_playwright() as pw:
            ctx = await chromium(pw, {"width": 1000, "height": 800})
            try:
                page = await ctx.new_page()
                await page.goto(f"{url}/?group={gid}&poll=150")
                await page.wait_for_function(
                    "() => document.getElementById('pool-cores').textContent !== '–'",
                    timeout=10000)
                assert await page.text_content("#pool-cores") == "8 on 1 machine"
                assert await page.text_content("#pool-ram") == "512 MiB"
                assert await page.text_content("#pool-eta") == "1h06m (to step 50)"
                assert await page.locator("#heldout-none").is_visible()
                assert await page.locator("#heldout-chart").is_hidden()
                assert (await page.text_content("#health")).endswith(
                    "Data: the built-in corpus.")
            finally:
                await ctx.close()
        await ws.close()
    finally:
        await session.close()
        await runner.cleanup()


def test_pool_script_never_parses_peer_strings_as_html() -> None:
    script = (find_static_dir() / "pool.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                 "eval(", "new Function"):
        assert sink not in script, sink
