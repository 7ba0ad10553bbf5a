"""The dashboard in headless Chromium (Debian's package) against a real signaling server.

Fake peers are real WebSocket clients: they post status reports with a falling loss, and
the fake host forwards the page's decisions as a real host peer does. The page must draw
a moving loss curve and the round fields, approve a waiting peer by a click with the host
key, show divergence in red, offer no way to approve without the key, show a room to a
member's key but never to a member's id, and show a hostile name as inert text.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from playwright.async_api import BrowserContext, async_playwright

from signaling.server import create_app

ROOM = "dash-room"
# Markup, an ANSI colour and a bidi override: the page must show it as text, cleaned.
HOSTILE = '<img src=x onerror="window.pwned=1">\x1b[31mmal\u202elory'
HOSTILE_SHOWN = '<img src=x onerror="window.pwned=1">mallory'


async def recv(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 5.0) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), timeout)
        if msg["type"] == kind:
            return msg


def status(step: int, loss: float, hsh: str, **extra: object) -> dict:
    return {"type": "status", "step": step, "loss": loss, "hash": hsh, "peers": 3} | extra


async def host_loop(ws: aiohttp.ClientWebSocketResponse, decisions: list[dict]) -> None:
    """What a host peer does with a dashboard decision: approve or deny by itself."""
    async for raw in ws:
        if raw.type != aiohttp.WSMsgType.TEXT:
            break
        msg = raw.json()
        if msg["type"] == "decision":
            decisions.append(msg)
            kind = "approve" if msg["approve"] else "deny"
            await ws.send_json({"type": kind, "id": msg["id"]})


async def reporter(
    ws: aiohttp.ClientWebSocketResponse, stop: asyncio.Event, steps: list[int]
) -> None:
    """The host's training progress: one report per 50 ms with a falling loss, in rounds
    of 4 steps with a held-out loss every 10th step."""
    step = 0
    while not stop.is_set():
        steps.append(step)
        loss = 5.0 * math.exp(-step / 30) + 0.1 * math.sin(step)
        extra = {"heldout_loss": loss + 0.5} if step % 10 == 0 else {}
        await ws.send_json(
            status(step, loss, "aaaa", tokens_per_s=1500, probe="ok", state="training",
                   mode="rounds H=4-16 int8", round=step // 4 + 1, comm_share=0.25,
                   round_steps=12, exchange_steps=11, transport="libwebrtc", **extra)
        )
        step += 1
        await asyncio.sleep(0.05)


@dataclass
class Room:
    """The fake peers of one private room and what the fake host has seen."""

    session: aiohttp.ClientSession
    url: str
    key: str
    host: aiohttp.ClientWebSocketResponse
    host_id: str
    carol: aiohttp.ClientWebSocketResponse
    carol_id: str
    carol_key: str  # her member key: what opens the room to her page
    bob: aiohttp.ClientWebSocketResponse
    bob_id: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    steps: list[int] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)


async def test_dashboard_in_chromium(tmp_path: Path, chromium) -> None:
    runner = web.AppRunner(create_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    session = aiohttp.ClientSession()
    tasks: list[asyncio.Task] = []

    async def join(name: str) -> tuple[aiohttp.ClientWebSocketResponse, str]:
        ws = await session.ws_connect(url + "/ws", params={"room": ROOM, "name": name})
        return ws, (await recv(ws, "welcome"))["id"]

    try:
        # host alice, an approved member carol, and bob waiting
        host, host_id = await join("alice")
        key = (await recv(host, "host_key"))["key"]
        carol, carol_id = await join("carol")
        await host.send_json({"type": "approve", "id": carol_id})
        carol_key = (await recv(carol, "approved"))["member_key"]
        mallory, mallory_id = await join(HOSTILE)
        await host.send_json({"type": "approve", "id": mallory_id})
        await recv(mallory, "approved")
        bob, bob_id = await join("bob")
        room = Room(session, url, key, host, host_id, carol, carol_id, carol_key, bob, bob_id)
        tasks += [
            asyncio.create_task(host_loop(host, room.decisions)),
            asyncio.create_task(reporter(host, room.stop, room.steps)),
        ]
        async with async_playwright() as pw:
            ctx = await chromium(pw, {"width": 1100, "height": 900})
            try:
                await _drive(ctx, room, join, tmp_path)
            finally:
                await ctx.close()
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await session.close()
        await runner.cleanup()


async def _drive(ctx: BrowserContext, room: Room, join, tmp_path: Path) -> None:
    url, key, host, host_id = room.url, room.key, room.host, room.host_id
    carol, carol_id, bob, bob_id = room.carol, room.carol_id, room.bob, room.bob_id
    requests: list[str] = []
    ctx.on("request", lambda r: requests.append(r.url))
    errors: list[str] = []

    # the overview lists a public group with its progress, never the private room
    public = await room.session.ws_connect(url + "/ws", params={"name": "pub"})
    gid = (await recv(public, "welcome"))["group"]
    await public.send_json(status(7, 2.5, "cccc"))
    page = await ctx.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"{url}/?poll=150")
    await page.wait_for_selector(f'#groups tr[data-group="{gid}"]', timeout=10000)
    cells = await page.locator(f'#groups tr[data-group="{gid}"] td').all_text_contents()
    assert cells == [gid, "1", "7", "2.5000"]
    assert await page.locator("#groups tbody tr").count() == 1
    await page.click(f'#groups tr[data-group="{gid}"] a')
    await page.locator("#members tbody tr").filter(has_text="pub").wait_for(timeout=10000)
    assert await page.text_content("#step") == "7"
    await public.close()

    await page.goto(f"{url}/?room={ROOM}&key={key}&poll=150")

    # the loss curve is drawn and grows as reports arrive
    line = page.locator(f"#loss-{host_id}")
    await line.wait_for(state="attached", timeout=10000)
    before = await line.get_attribute("points")
    await page.wait_for_function(
        "([id, old]) => { const l = document.getElementById('loss-' + id);"
        " return l && l.getAttribute('points') !== old && Number(l.dataset.count) > 5; }",
        arg=[host_id, before],
        timeout=10000,
    )
    after = await line.get_attribute("points")
    assert after != before and len(after.split()) > len(before.split())
    await page.wait_for_function(
        "() => document.getElementById('run-state').textContent === 'training'", timeout=10000
    )
    assert float(await page.text_content("#tokens")) == 1500
    # issue 13's fields: mode, newest round, mean comm share, newest held-out loss
    await page.wait_for_function(
        "() => /^\\d\\.\\d{4} \\(step \\d+\\)$/.test("
        "document.getElementById('heldout').textContent)", timeout=10000)
    assert await page.text_content("#mode") == "rounds H=4-16 int8"
    assert await page.text_content("#comm-share") == "25%"
    # the newest round, its length and the exchange the leader chose it for
    shown = re.fullmatch(r"(\d+) · 12 steps \(exchange 11\)",
                         await page.text_content("#round"))
    assert shown is not None and int(shown[1]) >= 1
    host_row = f'#members tr[data-peer="{host_id}"]'
    assert await page.text_content(host_row + " td.comm") == "25%"
    assert await page.text_content(host_row + " td.heldout") != "–"
    assert await page.text_content(host_row + " td.transport") == "libwebrtc"  # issue 17

    # a hostile name is text: no element made of it, no script run, escapes gone
    mal = page.locator("#members tbody tr").filter(has_text="mallory")
    assert await mal.locator("td span").last.text_content() == HOSTILE_SHOWN
    assert await page.locator("#members img, #legend img").count() == 0
    assert await page.evaluate("() => window.pwned") is None

    # Accept bob by clicking; the decision reaches the host, which approves him
    accept = page.locator(f'.waiting-row[data-peer="{bob_id}"] button.accept')
    await accept.wait_for(timeout=10000)
    assert await page.locator(".waiting-row .name").all_text_contents() == ["bob"]
    await page.screenshot(path=str(tmp_path / "dashboard-waiting.png"), full_page=True)
    await accept.click()
    await recv(bob, "approved")
    assert room.decisions == [{"type": "decision", "id": bob_id, "approve": True}]
    await page.wait_for_selector(f'#members tr[data-peer="{bob_id}"]', timeout=10000)
    assert await page.locator(".waiting-row").count() == 0

    # everyone reports the same step; bob's weight hash differs: shown in red
    room.stop.set()
    await asyncio.sleep(0.1)  # let the reporter's last send land first
    top = room.steps[-1] + 1
    for ws, hsh, probe, state, tps in [
        (host, "aaaa", "ok", "training", 900),
        (carol, "aaaa", "ok", "training", 1000),
        (bob, "bbbb", "bad", "halted", 1100),
    ]:
        await ws.send_json(status(top, 0.9, hsh, tokens_per_s=tps, probe=probe, state=state))
    await page.wait_for_function(
        "(top) => document.getElementById('hash-summary').textContent"
        " === 'DIVERGED at step ' + top",
        arg=top,
        timeout=10000,
    )
    row = '#members tr[data-peer="{}"]'
    assert "diverged" in await page.get_attribute(row.format(bob_id) + " td.hash", "class")
    assert "diverged" not in await page.get_attribute(row.format(carol_id) + " td.hash", "class")
    assert "bad" in await page.get_attribute(row.format(bob_id) + " td.probe", "class")
    assert await page.get_attribute("#hash-summary", "class") == "diverged"
    assert await page.text_content("#probe-summary") == "1 bad"
    # each peer measures the group's rate: the card shows their mean, not their sum
    assert float(await page.text_content("#tokens")) == 1000
    red = await page.eval_on_selector("#hash-summary", "e => getComputedStyle(e).color")
    assert red == "rgb(192, 21, 27)"
    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    print("dashboard screenshots:", shot, tmp_path / "dashboard-waiting.png")

    # a page without the key: watches (as a member), never approves
    watcher = await ctx.new_page()
    watcher.on("pageerror", lambda e: errors.append(str(e)))
    await watcher.goto(f"{url}/?room={ROOM}&member={room.carol_key}&poll=150")
    await watcher.wait_for_selector(f'#members tr[data-peer="{host_id}"]', timeout=10000)
    dan, dan_id = await join("dan")
    try:
        await watcher.wait_for_function(
            "() => /1 waiting/.test(document.getElementById('waiting').textContent)",
            timeout=10000,
        )
        assert await watcher.locator("button.accept").count() == 0
        assert "dan" not in await watcher.text_content("#waiting")
        forged = await watcher.evaluate(
            """async ([room, id]) => (await fetch('/api/rooms/' + room + '/decide', {
                 method: 'POST', headers: {'Content-Type': 'application/json'},
                 body: JSON.stringify({key: 'forged', id, approve: true})})).status""",
            [ROOM, dan_id],
        )
        assert forged == 403
        await asyncio.sleep(0.2)
        assert len(room.decisions) == 1  # nothing forged reached the host
        # while the host's page, with the key, does offer dan
        await page.wait_for_selector(f'.waiting-row[data-peer="{dan_id}"] button.accept')
        # a stranger with only the room code sees nothing of the room
        stranger = await ctx.new_page()
        await stranger.goto(f"{url}/?room={ROOM}&poll=150")
        await stranger.wait_for_selector("#error:not([hidden])", timeout=10000)
        assert await stranger.locator("#group").is_hidden()
        assert "bob" not in await stranger.content()
        # nor does a member's id, which anyone in the room (and once, a waiting peer) saw
        await stranger.goto(f"{url}/?room={ROOM}&peer={host_id}&member={host_id}&poll=150")
        await stranger.wait_for_selector("#error:not([hidden])", timeout=10000)
        assert await stranger.locator("#group").is_hidden()
        assert "alice" not in await stranger.content()
        # the host's page denies dan: the host peer refuses him and the server drops him
        await page.click(f'.waiting-row[data-peer="{dan_id}"] button.deny')
        await recv(dan, "denied")
        assert room.decisions[-1] == {"type": "decision", "id": dan_id, "approve": False}
        await page.wait_for_function("() => !document.querySelector('.waiting-row')", timeout=10000)
    finally:
        await dan.close()

    assert not errors, errors
    assert all(u.startswith(url) for u in requests), [u for u in requests if not u.startswith(url)]
