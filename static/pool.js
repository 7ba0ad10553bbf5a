// The pool view: each member's machine (CPU model, cores, RAM), kernel backend,
// transport, batch share, own tokens/s and communication share; for the group the pooled
// cores and RAM, the ETA, the link matrix (which pairs are connected and the round-trip
// time each member measures on its heartbeats) and the held-out loss curve.
// Loaded before dashboard.js, whose helpers (el, svg, clip, fmt, pct, isNum, $) it uses
// when drawGroup calls drawPool. Every peer string goes through clip(), as text.
"use strict";

const POOL_FIELD = 64; // the server's bound on the CPU model (signaling.protocol.MAX_CPU_CHARS)
const HELDOUT_CHART = { w: 640, h: 180, left: 48, right: 10, top: 10, bottom: 24 };

function duration(seconds) {
  if (!isNum(seconds)) return "–";
  const s = Math.round(seconds);
  if (s >= 3600) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60))
    .padStart(2, "0") + "m";
  if (s >= 60) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return s + "s";
}

function mib(mb) {
  return mb >= 1024 ? (mb / 1024).toFixed(1) + " GiB" : mb + " MiB";
}

// Pooled cores and RAM of the members that said what their machine is, each machine
// once: members naming the same machine (peers sharing one computer) count as one, with
// the most cores and RAM any of them reports (a peer pinned to one core reports one).
function poolTotals(info) {
  const byMachine = new Map();
  let reporting = 0;
  for (const m of info.members) {
    const r = info.reports[m.id];
    if (!r || !isNum(r.cores)) continue;
    reporting += 1;
    const key = typeof r.machine === "string" ? "m:" + r.machine : "p:" + m.id;
    const seen = byMachine.get(key) || { cores: 0, ram: 0 };
    seen.cores = Math.max(seen.cores, r.cores);
    if (isNum(r.ram_mb)) seen.ram = Math.max(seen.ram, r.ram_mb);
    byMachine.set(key, seen);
  }
  let cores = 0;
  let ram = 0;
  for (const t of byMachine.values()) {
    cores += t.cores;
    ram += t.ram;
  }
  return { cores, ram, machines: byMachine.size, silent: info.members.length - reporting };
}

// The run's ETA: what the most advanced training member expects (all see the same steps).
function poolEta(info) {
  const training = Object.values(info.reports).filter((r) => r.state === "training" &&
    isNum(r.eta_s));
  if (!training.length) {
    const done = Object.values(info.reports).some((r) => r.state === "done");
    return done ? "done" : "–";
  }
  const top = training.sort((a, b) => b.step - a.step)[0];
  return duration(top.eta_s) + (isNum(top.total_steps) ? " (to step " + top.total_steps +
    ")" : "");
}

function drawPoolCards(info) {
  const t = poolTotals(info);
  const note = t.silent ? " (" + t.silent + " not reporting)" : "";
  $("pool-cores").textContent = t.machines ? t.cores + " on " + t.machines + " machine" +
    (t.machines === 1 ? "" : "s") + note : "–";
  $("pool-ram").textContent = t.machines ? mib(t.ram) + note : "–";
  $("pool-eta").textContent = poolEta(info);
}

function drawMachines(info, names) {
  const tbody = $("machines").querySelector("tbody");
  tbody.replaceChildren();
  for (const m of info.members) {
    const r = info.reports[m.id] || {};
    const tr = el("tr");
    tr.dataset.peer = m.id;
    const str = (x, n) => (typeof x === "string" ? clip(x, n) : "–");
    tr.append(
      el("td", names[m.id]),
      el("td", str(r.cpu, POOL_FIELD), "cpu"),
      el("td", isNum(r.cores) ? r.cores : "–", "cores"),
      el("td", isNum(r.ram_mb) ? mib(r.ram_mb) : "–", "ram"),
      el("td", str(r.backend, 16), "backend"),
      el("td", str(r.transport, 16), "transport"),
      el("td", isNum(r.share) ? (r.share * 100).toFixed(1) + "%" : "–", "share"),
      el("td", isNum(r.peer_tokens_per_s) ? fmt(r.peer_tokens_per_s, 0) : "–", "speed"),
      el("td", pct(r.comm_share), "comm"));
    tbody.appendChild(tr);
  }
}

// Row: the member that measured; column: the member at the other end. A member that
// reports links but none to a peer has no link to it; one that reports none is unknown.
function drawLinkMatrix(info, names) {
  const table = $("link-matrix");
  table.replaceChildren();
  const ids = info.members.map((m) => m.id);
  const head = el("tr");
  head.appendChild(el("th", "from \\ to"));
  for (const id of ids) head.appendChild(el("th", names[id]));
  const thead = el("thead");
  thead.appendChild(head);
  const tbody = el("tbody");
  for (const from of ids) {
    const r = info.reports[from];
    const links = r && r.links && typeof r.links === "object" ? r.links : null;
    const tr = el("tr");
    tr.dataset.peer = from;
    tr.appendChild(el("th", names[from]));
    for (const to of ids) {
      let td;
      if (from === to) td = el("td", "·", "self");
      else if (!links) td = el("td", "?", "unknown");
      else if (!(to in links)) td = el("td", "no link", "down");
      else if (isNum(links[to])) td = el("td", links[to].toFixed(1) + " ms", "up");
      else td = el("td", "up", "up");
      td.dataset.to = to;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
  table.append(thead, tbody);
}

function drawHeldout(info, colorOf) {
  const box = $("heldout-chart");
  const series = Object.entries(info.heldout_history || {}).filter(([, pts]) => pts.length);
  const all = series.flatMap(([, pts]) => pts);
  box.replaceChildren();
  $("heldout-none").hidden = all.length > 0;
  box.toggleAttribute("hidden", !all.length); // an <svg> has no .hidden property
  if (!all.length) return;
  const C = HELDOUT_CHART;
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => C.left + ((x - x0) / (x1 - x0)) * (C.w - C.left - C.right);
  const sy = (y) => C.top + (1 - (y - y0) / (y1 - y0)) * (C.h - C.top - C.bottom);
  for (let i = 0; i <= 3; i++) {
    const y = y0 + ((y1 - y0) * i) / 3;
    box.appendChild(svg("line", { x1: C.left, x2: C.w - C.right, y1: sy(y), y2: sy(y),
      class: "grid" }));
    box.appendChild(svg("text", { x: 2, y: sy(y) + 3 })).textContent = y.toPrecision(4);
  }
  box.appendChild(svg("text", { x: C.left, y: C.h - 6 })).textContent = "step " + x0;
  box.appendChild(svg("text", { x: C.w - C.right - 60, y: C.h - 6 })).textContent =
    "step " + x1;
  for (const [id, pts] of series) {
    const line = svg("polyline", { class: "loss-line", stroke: colorOf(id),
      points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ") });
    line.id = "heldout-" + id;
    line.dataset.count = String(pts.length);
    box.appendChild(line);
    for (const p of pts) {
      box.appendChild(svg("circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1),
        r: 2.5, fill: colorOf(id) }));
    }
  }
}

function drawPool(info, colorOf, names) {
  drawPoolCards(info);
  drawMachines(info, names);
  drawLinkMatrix(info, names);
  drawHeldout(info, colorOf);
}
