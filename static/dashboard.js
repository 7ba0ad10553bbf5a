// daisyweb dashboard: polls the signaling server's JSON API and draws what it holds.
// No build step and no outside files. Every value from the server (peer names above all)
// goes into the page through textContent / setAttribute, never as HTML, and every string a
// peer chose is shown through clip(): cleaned and bounded again, whatever the server did.
"use strict";

const params = new URLSearchParams(location.search);
const ROOM = params.get("room");
const GROUP = params.get("group");
const KEY = params.get("key"); // the host link's secret (valid while that peer hosts); only sent to this server
const MEMBER = params.get("member"); // a member's own view secret (not its id)
const POLL_MS = Math.max(100, Number(params.get("poll")) || 1000);
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
  "#17becf", "#7f7f7f", "#bcbd22"];
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { w: 640, h: 220, left: 48, right: 10, top: 10, bottom: 24 };

const MAX_NAME = 64; // the server's bound on names (signaling.protocol.MAX_NAME_CHARS)
const MAX_FIELD = 48; // and on status strings (mode; hash and probe are shorter)

const $ = (id) => document.getElementById(id);
const pending = new Set(); // waiting ids whose decision was sent, until the host acts

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

// Control, format and separator characters (ANSI escapes start with one) never reach
// the page; long strings are cut with an ellipsis.
const HIDDEN = /[\p{Cc}\p{Cf}\p{Cs}\p{Zl}\p{Zp}]/gu;

function clip(text, max) {
  const s = String(text ?? "").replace(HIDDEN, "");
  const chars = [...s];
  return chars.length > max ? chars.slice(0, max - 1).join("") + "…" : s;
}

const isNum = (x) => typeof x === "number" && isFinite(x);

function fmt(x, digits) {
  return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
}

function showError(text) {
  const e = $("error");
  e.hidden = !text;
  e.textContent = text || "";
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) {
    const err = new Error("HTTP " + r.status);
    err.status = r.status;
    throw err;
  }
  return r.json();
}

// ---- overview ---------------------------------------------------------------------------

// ---- the server and the dataset /data serves -----------------------------------------------

function dataLine(d) {
  if (!d || typeof d !== "object") return "";
  if (d.source !== "hub") return " Data: the built-in corpus.";
  const parts = [d.config, d.split && "split " + d.split,
    d.text_column && "column " + d.text_column].filter((x) => typeof x === "string" && x);
  const fallback = d.last === "builtin" ? "; unreachable now, serving the built-in corpus" : "";
  return " Data: " + clip(d.dataset, 96) + " (" + parts.map((p) => clip(p, 64)).join(", ") +
    fallback + ").";
}

function drawHealth(h) {
  $("health").textContent = "Server is up: " + h.groups + " groups, " + h.peers + " peers." +
    dataLine(h.data);
}

async function refreshOverview() {
  const h = await getJSON("/healthz");
  drawHealth(h);
  const g = await getJSON("/api/groups");
  const tbody = $("groups").querySelector("tbody");
  tbody.replaceChildren();
  for (const grp of g.groups) {
    const tr = el("tr");
    tr.dataset.group = grp.id;
    const a = el("a", grp.id);
    a.href = "/?group=" + encodeURIComponent(grp.id);
    const td = el("td");
    td.appendChild(a);
    tr.append(td, el("td", grp.members), el("td", grp.status ? grp.status.step : "–"),
      el("td", grp.status ? fmt(grp.status.loss, 4) : "–"));
    tbody.appendChild(tr);
  }
  $("no-groups").hidden = g.groups.length > 0;
}

// ---- one group ----------------------------------------------------------------------------

function detailURL() {
  const q = new URLSearchParams();
  if (KEY) q.set("key", KEY);
  if (MEMBER) q.set("member", MEMBER);
  const base = ROOM ? "/api/rooms/" + encodeURIComponent(ROOM) : "/api/groups/" +
    encodeURIComponent(GROUP);
  return base + (q.toString() ? "?" + q : "");
}

// Peers at the newest reported step should all hold the same weight hash; a peer whose hash
// differs from the majority there has diverged. Peers still at older steps are "behind".
function hashVerdicts(reports) {
  const ids = Object.keys(reports);
  const verdict = {};
  if (!ids.length) return { verdict, summary: null, diverged: false };
  const top = Math.max(...ids.map((id) => reports[id].step));
  const counts = {};
  for (const id of ids) {
    if (reports[id].step === top) counts[reports[id].hash] = (counts[reports[id].hash] || 0) + 1;
  }
  const major = Object.keys(counts).sort((a, b) => counts[b] - counts[a])[0];
  const diverged = Object.keys(counts).length > 1;
  for (const id of ids) {
    const r = reports[id];
    verdict[id] = r.step !== top ? "behind" : diverged && r.hash !== major ? "diverged" : "ok";
  }
  return { verdict, diverged, top, summary: diverged
    ? "DIVERGED at step " + top : "all equal at step " + top };
}

// "ok"/"bad" are verdicts; any other string is a probe result hash, which must agree.
function probeVerdicts(reports) {
  const verdict = {};
  const counts = {};
  for (const [id, r] of Object.entries(reports)) {
    if (r.probe !== undefined && r.probe !== "ok" && r.probe !== "bad") {
      counts[r.probe] = (counts[r.probe] || 0) + 1;
    }
  }
  const major = Object.keys(counts).sort((a, b) => counts[b] - counts[a])[0];
  let bad = 0;
  let seen = 0;
  for (const [id, r] of Object.entries(reports)) {
    if (r.probe === undefined) continue;
    seen += 1;
    const isBad = r.probe === "bad" || (r.probe !== "ok" && r.probe !== major);
    verdict[id] = isBad ? "bad" : "ok";
    if (isBad) bad += 1;
  }
  const summary = !seen ? "–" : bad ? bad + " bad" : "all ok";
  return { verdict, summary, bad };
}

function runState(reports) {
  const counts = {};
  for (const r of Object.values(reports)) {
    if (r.state) counts[r.state] = (counts[r.state] || 0) + 1;
  }
  const names = Object.keys(counts);
  if (!names.length) return "–";
  if (names.length === 1) return names[0];
  return names.map((n) => n + " (" + counts[n] + ")").join(", ");
}

// The exchange's fields: the mode, the newest round, the mean share of time spent
// communicating, and the newest held-out loss with the step it was measured at.
function roundFields(reports) {
  const rs = Object.values(reports);
  const modes = [...new Set(rs.map((r) => r.mode).filter((m) => typeof m === "string"))];
  const rounds = rs.map((r) => r.round).filter(isNum);
  // The newest round's length, and the slowest exchange it was chosen for (the leader
  // names the shortest round within the run's bounds whose compute covers it).
  const paced = rs.filter((r) => isNum(r.round) && isNum(r.round_steps))
    .sort((a, b) => b.round - a.round)[0];
  const pace = paced ? " · " + paced.round_steps + " steps" +
    (isNum(paced.exchange_steps) ? " (exchange " + paced.exchange_steps + ")" : "") : "";
  const shares = rs.map((r) => r.comm_share).filter(isNum);
  const evals = rs.filter((r) => isNum(r.heldout_loss))
    .sort((a, b) => (b.heldout_step ?? b.step) - (a.heldout_step ?? a.step));
  const newest = evals[0];
  return {
    mode: modes.length ? modes.map((m) => clip(m, MAX_FIELD)).join(", ") : "–",
    round: rounds.length ? String(Math.max(...rounds)) + pace : "–",
    comm: shares.length ? pct(shares.reduce((s, x) => s + x, 0) / shares.length) : "–",
    heldout: newest ? fmt(newest.heldout_loss, 4) +
      (isNum(newest.heldout_step) ? " (step " + newest.heldout_step + ")" : "") : "–",
  };
}

function pct(share) {
  return isNum(share) ? (share * 100).toFixed(0) + "%" : "–";
}

function drawChart(info, colorOf) {
  const axes = $("axes");
  const lines = $("lines");
  const series = Object.entries(info.history).filter(([, pts]) => pts.length);
  const all = series.flatMap(([, pts]) => pts);
  axes.replaceChildren();
  if (!all.length) {
    lines.replaceChildren();
    axes.appendChild(svg("text", { x: CHART.w / 2 - 60, y: CHART.h / 2 })).textContent =
      "no status reports yet";
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pw = CHART.w - CHART.left - CHART.right;
  const ph = CHART.h - CHART.top - CHART.bottom;
  const sx = (x) => CHART.left + ((x - x0) / (x1 - x0)) * pw;
  const sy = (y) => CHART.top + (1 - (y - y0) / (y1 - y0)) * ph;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    axes.appendChild(svg("line", { x1: CHART.left, x2: CHART.w - CHART.right, y1: sy(y),
      y2: sy(y), class: "grid" }));
    axes.appendChild(svg("text", { x: 2, y: sy(y) + 3 })).textContent = y.toPrecision(4);
  }
  axes.appendChild(svg("text", { x: CHART.left, y: CHART.h - 6 })).textContent = "step " + x0;
  axes.appendChild(svg("text", { x: CHART.w - CHART.right - 60, y: CHART.h - 6 }))
    .textContent = "step " + x1;
  // Keep one polyline per peer and update its points, so the curve grows in place.
  const keep = new Set();
  for (const [id, pts] of series) {
    keep.add("loss-" + id);
    let line = document.getElementById("loss-" + id);
    if (!line) {
      line = svg("polyline", { id: "loss-" + id, class: "loss-line" });
      lines.appendChild(line);
    }
    line.setAttribute("stroke", colorOf(id));
    line.setAttribute("points", pts.map((p) => sx(p[0]).toFixed(1) + "," +
      sy(p[1]).toFixed(1)).join(" "));
    line.dataset.count = String(pts.length);
    // a dot on the newest point, so a peer with a single report is visible too
    let dot = document.getElementById("last-" + id);
    if (!dot) {
      dot = svg("circle", { id: "last-" + id, r: 2.5 });
      lines.appendChild(dot);
    }
    keep.add("last-" + id);
    const last = pts[pts.length - 1];
    dot.setAttribute("cx", sx(last[0]).toFixed(1));
    dot.setAttribute("cy", sy(last[1]).toFixed(1));
    dot.setAttribute("fill", colorOf(id));
  }
  for (const node of [...lines.children]) if (!keep.has(node.id)) node.remove();
}

let waitingDrawn = "";
let shown = false; // this page has drawn its group at least once

function drawWaiting(info) {
  const box = $("waiting");
  const waiting = info.waiting_peers || [];
  for (const id of [...pending]) if (!waiting.some((w) => w.id === id)) pending.delete(id);
  // Rebuild only on change: a button replaced between mouse-down and mouse-up loses the click.
  const drawn = JSON.stringify([info.can_decide, info.waiting, waiting, [...pending]]);
  if (drawn === waitingDrawn) return;
  waitingDrawn = drawn;
  box.replaceChildren();
  if (!info.can_decide) {
    box.appendChild(el("p", info.waiting
      ? info.waiting + " waiting. Only the host's dashboard link can accept or deny."
      : "None.", "hint"));
    return;
  }
  if (!waiting.length) box.appendChild(el("p", "None.", "hint"));
  for (const w of waiting) {
    const row = el("div", null, "waiting-row");
    row.dataset.peer = w.id;
    row.append(el("span", clip(w.name, MAX_NAME), "name"), el("code", w.id));
    for (const approve of [true, false]) {
      const b = el("button", approve ? "Accept" : "Deny", approve ? "accept" : "deny");
      b.disabled = pending.has(w.id);
      b.addEventListener("click", () => decide(w, approve));
      row.appendChild(b);
    }
    box.appendChild(row);
  }
}

async function decide(peer, approve) {
  pending.add(peer.id);
  const sel = `.waiting-row[data-peer="${CSS.escape(peer.id)}"] button`;
  for (const b of document.querySelectorAll(sel)) {
    b.disabled = true;
  }
  const msg = $("decision-msg");
  try {
    const r = await fetch("/api/rooms/" + encodeURIComponent(ROOM) + "/decide", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ key: KEY, id: peer.id, approve }),
    });
    if (r.status === 409) { // a decision for this peer already went to the host: it stands
      msg.textContent = "A decision for " + clip(peer.name, MAX_NAME) +
        " was already sent to the host peer.";
      return;
    }
    if (!r.ok) throw new Error(clip(await r.text(), 200) || "HTTP " + r.status);
    msg.textContent = (approve ? "Accept" : "Deny") + " for " + clip(peer.name, MAX_NAME) +
      " sent to the host peer.";
  } catch (e) {
    pending.delete(peer.id);
    msg.textContent = "Decision not sent: " + e.message;
  }
}

function drawGroup(info) {
  const colors = {};
  const colorOf = (id) => colors[id] || (colors[id] = COLORS[Object.keys(colors).length %
    COLORS.length]);
  info.members.forEach((m) => colorOf(m.id));
  const reports = info.reports;
  const names = Object.fromEntries(info.members.map((m) => [m.id, clip(m.name, MAX_NAME)]));
  $("title").textContent = (ROOM ? "Room " + ROOM : "Group " + info.id) +
    (info.can_decide ? " (host view)" : "");
  const hv = hashVerdicts(reports);
  const pv = probeVerdicts(reports);
  const latest = Object.values(reports).sort((a, b) => b.step - a.step)[0];
  $("run-state").textContent = runState(reports);
  $("run-state").className = /halted/.test($("run-state").textContent) ? "bad" : "";
  $("step").textContent = latest ? latest.step : "–";
  // Each peer reports the loss of its own batches: the group's loss at a step is their mean
  // (every roster member's contribution counts equally), not whichever report sorts first.
  const atTop = latest ? Object.values(reports).filter((r) => r.step === latest.step) : [];
  $("loss").textContent = atTop.length
    ? fmt(atTop.reduce((s, r) => s + r.loss, 0) / atTop.length, 4) : "–";
  // Each peer reports the group's tokens/s as it measures it: show their mean.
  const tps = Object.values(reports).filter((r) => typeof r.tokens_per_s === "number");
  $("tokens").textContent = tps.length
    ? fmt(tps.reduce((s, r) => s + r.tokens_per_s, 0) / tps.length, 0) : "–";
  $("hash-summary").textContent = hv.summary || "–";
  $("hash-summary").className = hv.diverged ? "diverged" : hv.summary ? "ok" : "";
  $("probe-summary").textContent = pv.summary;
  $("probe-summary").className = pv.bad ? "bad" : pv.summary === "all ok" ? "ok" : "";
  const rf = roundFields(reports);
  $("mode").textContent = rf.mode;
  $("round").textContent = rf.round;
  $("comm-share").textContent = rf.comm;
  $("heldout").textContent = rf.heldout;

  const tbody = $("members").querySelector("tbody");
  tbody.replaceChildren();
  for (const m of info.members) {
    const r = reports[m.id];
    const tr = el("tr");
    tr.dataset.peer = m.id;
    const name = el("td");
    const swatch = el("i");
    swatch.style.background = colorOf(m.id);
    name.append(swatch, el("span", names[m.id]));
    const role = el("td");
    if (m.id === info.host) role.appendChild(el("span", "host", "host-tag"));
    const hash = el("td", r ? clip(r.hash, MAX_FIELD) : "–", "hash " +
      (r ? hv.verdict[m.id] : ""));
    const probe = el("td", r && r.probe !== undefined ? clip(r.probe, MAX_FIELD) : "–",
      "probe " + (r && pv.verdict[m.id] ? pv.verdict[m.id] : ""));
    const age = r ? Math.max(0, info.now - r.t).toFixed(0) + " s ago" : "–";
    tr.append(name, el("td", m.id), role, el("td", r ? r.step : "–"),
      el("td", r ? fmt(r.loss, 4) : "–"), el("td", r ? fmt(r.tokens_per_s, 0) : "–"), hash,
      probe, el("td", r && r.state ? clip(r.state, MAX_FIELD) : "–",
        r && r.state === "halted" ? "bad" : ""),
      el("td", r && isNum(r.round) ? r.round : "–", "round"),
      el("td", r ? pct(r.comm_share) : "–", "comm"),
      el("td", r && isNum(r.heldout_loss) ? fmt(r.heldout_loss, 4) : "–", "heldout"),
      el("td", r && typeof r.transport === "string" ? clip(r.transport, MAX_FIELD) : "–",
        "transport"),
      el("td", age));
    tbody.appendChild(tr);
  }

  drawChart(info, colorOf);
  drawPool(info, colorOf, names);
  const legend = $("legend");
  legend.replaceChildren();
  for (const id of Object.keys(info.history)) {
    const item = el("span");
    const sw = el("i");
    sw.style.background = colorOf(id);
    item.append(sw, document.createTextNode(names[id] || id));
    legend.appendChild(item);
  }
  drawWaiting(info);
}

async function refreshGroup() {
  const h = await getJSON("/healthz");
  drawHealth(h);
  let info;
  try {
    info = await getJSON(detailURL());
  } catch (e) {
    if (e.status === 404 && shown) {
      // The room emptied (every peer left, as at the end of a run) or this link's key
      // was retired: keep what was last seen, but nothing in it can be decided any more.
      showError("This room is gone from the server: every peer has left (a finished run " +
        "ends this way), " + (KEY
          ? "or hosting changed hands (the new host prints a new link). "
          : "or the member whose key is in ?member= has left (use another member's link). ") +
        "Below is the last state seen.");
      $("waiting").replaceChildren(el("p", "–", "hint"));
      waitingDrawn = "";
      pending.clear();
      return;
    }
    if (e.status === 404) {
      $("group").hidden = true;
      showError(ROOM
        ? "No such room, or you may not see it: a private room is shown only with the " +
          "current host's link (it stops working when hosting changes hands) or the " +
          "member key the server gave one of its current members (?member=KEY); a " +
          "member's id does not open it."
        : "No such group (it may have emptied).");
      return;
    }
    throw e;
  }
  showError("");
  $("group").hidden = false;
  drawGroup(info);
  shown = true;
}

async function tick() {
  try {
    await (ROOM || GROUP ? refreshGroup() : refreshOverview());
  } catch (e) {
    $("health").textContent = "Server unreachable.";
  }
  setTimeout(tick, POLL_MS);
}

$("overview").hidden = Boolean(ROOM || GROUP);
tick();
