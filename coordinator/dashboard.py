"""The dashboard: one self-contained HTML page (no CDN, no external file) that polls the coordinator's public API.

Sections, each an element with its id: `health` (when the last version came and, when training is blocked or
stalled, why: the watchdog's words), `summary` (version, groups by outcome, nodes by state, ledger totals),
`training` (reward and accuracy curves and the nodes' idle share over trainer steps, inline SVG), `spread` (live
nodes per held policy version: how far each checkpoint has spread), `verification` (outcomes, and rejection
reasons by kind with an example), `nodes` (each node with its state: live, gone or banned) and `ledger` (the largest
contributors, one row per node). Data: /v1/status, /v1/overview, /v1/ledger/nodes. Every value
from the server is inserted as text, never as HTML: node names and reasons come from untrusted nodes.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>swarmrl coordinator</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
 .muted { color: #777; } .err { color: #b00; }
 .cards { display: flex; gap: .8em; flex-wrap: wrap; }
 .card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .5em .9em; min-width: 7em; }
 .card b { display: block; font-size: 1.4em; }
 table { border-collapse: collapse; background: #fff; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
 th { background: #f0f0f0; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
 tr.banned td { color: #b00; } tr.gone td { color: #999; }
 .row { display: flex; gap: 1.5em; flex-wrap: wrap; align-items: flex-start; }
 svg { background: #fff; border: 1px solid #ddd; border-radius: 6px; }
 #health { padding: .45em .8em; border-radius: 6px; margin: .2em 0 .8em; background: #eef6ee; }
 #health.blocked { background: #fff6dd; } #health.stalled { background: #fde2e2; color: #900; font-weight: 600; }
</style></head><body>
<h1>swarmrl pool <span id="poolname"></span> <span id="run" class="muted"></span></h1>
<div id="err" class="err"></div>
<div id="health">-</div>
<section id="summary"><div class="cards">
 <div class="card">policy version<b id="version">-</b></div>
 <div class="card">groups accepted<b id="accepted">-</b></div>
 <div class="card">pending<b id="pending">-</b></div>
 <div class="card">held<b id="held">-</b></div>
 <div class="card">rejected<b id="rejected">-</b></div>
 <div class="card">nodes live / gone / banned<b id="nodestates">-</b></div>
 <div class="card">ledger tokens<b id="ledgertokens">-</b></div>
 <div class="card">receipts signed<b id="receipts">-</b></div>
</div></section>
<section id="training"><h2>Training</h2>
<div class="row"><div><div>accuracy</div><svg id="acc" width="420" height="200"></svg></div>
<div><div>reward</div><svg id="rew" width="420" height="200"></svg></div>
<div><div>node idle share since the previous step</div><svg id="idle" width="420" height="200"></svg></div></div>
</section>
<div class="row">
<section id="spread"><h2>Checkpoint spread</h2>
<div id="spread-text" class="muted"></div><svg id="spread-chart" width="420" height="200"></svg></section>
<section id="verification"><h2>Verification</h2>
<svg id="outcomes" width="420" height="120"></svg>
<table><thead><tr><th>rejection reason</th><th>groups</th><th>example</th></tr></thead>
<tbody id="reasons"></tbody></table></section>
</div>
<section id="nodes"><h2>Nodes</h2>
<table><thead><tr><th>node</th><th>name</th><th>state</th><th>engine</th><th>version</th><th>accepted</th>
<th>rejected</th><th>reputation</th><th>idle s</th><th>busy s</th><th>idle %</th><th>last seen</th></tr></thead>
<tbody id="nodelist"></tbody></table></section>
<section id="ledger"><h2>Ledger: largest contributors</h2>
<table><thead><tr><th>node</th><th>name</th><th>groups</th><th>tokens</th><th>versions</th><th>last accepted</th>
</tr></thead><tbody id="ledgerrows"></tbody></table>
<div class="muted">every node and version: GET /v1/ledger, or <code>swarmrl ledger --url</code></div></section>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"];
const TOP_CONTRIBUTORS = 50;

function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function chart(svg, series) {
  // series: {name: [[step, value], ...]}; drawn as lines on shared axes.
  clear(svg);
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 44, R = 10, T = 10, B = 24;
  const pts = Object.values(series).flat();
  if (!pts.length) { svg.appendChild(el("text", {x: W / 2 - 30, y: H / 2, fill: "#999"}, "no data yet")); return; }
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(0, ...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  for (const y of [y0, (y0 + y1) / 2, y1])
    svg.appendChild(el("text", {x: 2, y: sy(y) + 4, "font-size": 10, fill: "#555"}, y.toPrecision(3)));
  svg.appendChild(el("text", {x: L, y: H - 6, "font-size": 10, fill: "#555"}, "step " + x0));
  svg.appendChild(el("text", {x: W - R - 60, y: H - 6, "font-size": 10, fill: "#555"}, "step " + x1));
  Object.entries(series).forEach(([name, data], i) => {
    const c = COLORS[i % COLORS.length];
    svg.appendChild(el("polyline", {fill: "none", stroke: c, "stroke-width": 2,
                                    points: data.map(p => sx(p[0]) + "," + sy(p[1])).join(" ")}));
    for (const p of data) svg.appendChild(el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: c}));
    svg.appendChild(el("text", {x: L + 6, y: T + 12 + 12 * i, "font-size": 11, fill: c}, name));
  });
}

function bars(svg, items, color) {
  // items: [[label, value], ...]; horizontal bars, one per item.
  clear(svg);
  const W = +svg.getAttribute("width"), L = 90, R = 50, h = 20;
  svg.setAttribute("height", Math.max(40, 10 + items.length * (h + 4)));
  if (!items.length) { svg.appendChild(el("text", {x: 10, y: 25, fill: "#999"}, "nothing yet")); return; }
  const top = Math.max(1, ...items.map(i => i[1]));
  items.forEach(([label, value], k) => {
    const y = 6 + k * (h + 4), w = (W - L - R) * value / top;
    svg.appendChild(el("text", {x: 4, y: y + 14, "font-size": 12, fill: "#333"}, label));
    svg.appendChild(el("rect", {x: L, y: y, width: Math.max(w, 1), height: h, fill: color(label)}));
    svg.appendChild(el("text", {x: L + w + 4, y: y + 14, "font-size": 12, fill: "#333"}, String(value)));
  });
}

function seriesMatching(metrics, re) {
  const out = {};
  for (const row of metrics)
    for (const [k, v] of Object.entries(row.metrics))
      if (re.test(k)) (out[k] = out[k] || []).push([row.step, v]);
  return out;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text; if (cls) td.className = cls; tr.appendChild(td);
}

function ago(now, t) {
  const s = Math.max(0, now - t);
  if (s < 90) return s.toFixed(0) + " s ago";
  return s < 5400 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
}

async function get(path) {
  const r = await fetch(path, {cache: "no-store"});
  if (!r.ok) throw new Error(path + ": status " + r.status);
  return r.json();
}

function showStatus(s, ov) {
  const spec = s.run.spec;
  $("poolname").textContent = ov.pool_name || spec.run_id;
  showHealth(ov);
  $("run").textContent = [spec.run_id, spec.task.name, "group size " + spec.sampling.group_size,
                          "key " + s.run.coordinator_key.slice(0, 16)].join(" \\u00b7 ");
  $("version").textContent = ov.current_version;
  for (const k of ["accepted", "pending", "held", "rejected"]) $(k).textContent = ov.groups[k];
  $("nodestates").textContent = [ov.nodes.live, ov.nodes.gone, ov.nodes.banned].join(" / ");
  $("ledgertokens").textContent = ov.ledger_tokens.toLocaleString("en");
  $("receipts").textContent = ov.receipts;
  chart($("acc"), seriesMatching(s.metrics, /acc/i));
  chart($("rew"), seriesMatching(s.metrics, /reward/i));
  chart($("idle"), seriesMatching(s.metrics, /^node_idle_frac$/));

  const live = ov.spread.reduce((a, v) => a + v.nodes, 0);
  const current = ov.spread.filter(v => v.version === ov.current_version).reduce((a, v) => a + v.nodes, 0);
  $("spread-text").textContent = current + " of " + live + " live nodes hold the current version v" +
                                 ov.current_version;
  bars($("spread-chart"), ov.spread.map(v => [v.version < 0 ? "none" : "v" + v.version, v.nodes]),
       (label) => label === "v" + ov.current_version ? "#2ca02c" : "#9ecae1");
  const outcome = {accepted: "#2ca02c", held: "#ff7f0e", pending: "#9ecae1", rejected: "#d62728"};
  bars($("outcomes"), Object.keys(outcome).map(k => [k, ov.groups[k]]), (k) => outcome[k]);
  const reasons = $("reasons"); clear(reasons);
  for (const r of ov.reasons) {
    const tr = document.createElement("tr");
    cell(tr, r.reason); cell(tr, r.groups, "num"); cell(tr, r.example); reasons.appendChild(tr);
  }
  if (!ov.reasons.length) {
    const tr = document.createElement("tr"); cell(tr, "no rejections"); reasons.appendChild(tr);
  }

  const body = $("nodelist"); clear(body);
  for (const n of s.nodes) {
    const state = n.banned ? "banned" : (ov.now - n.last_seen > ov.gone_after_s ? "gone" : "live");
    const tr = document.createElement("tr"); tr.className = state;
    cell(tr, n.node_id.slice(0, 12)); cell(tr, n.name); cell(tr, state); cell(tr, n.engine);
    cell(tr, n.held_version, "num"); cell(tr, n.groups_accepted, "num"); cell(tr, n.groups_rejected, "num");
    cell(tr, n.reputation.toFixed(2), "num");
    const spent = n.idle_s + n.busy_s;
    cell(tr, n.idle_s.toFixed(0), "num"); cell(tr, n.busy_s.toFixed(0), "num");
    cell(tr, spent > 0 ? (100 * n.idle_s / spent).toFixed(0) : "", "num");
    cell(tr, ago(ov.now, n.last_seen)); body.appendChild(tr);
  }
}

function showHealth(ov) {
  const t = ov.training, h = $("health");
  if (!t) { h.textContent = ""; return; }
  const last = t.last_step_at === null ? "no version published yet" :
               "last new version " + ago(ov.now, t.last_step_at);
  h.className = t.stalled ? "stalled" : (t.blockers.length ? "blocked" : "");
  h.textContent = (t.stalled ? "Training has stopped: " : "") + last +
                  (t.why ? (t.stalled ? ". Why: " : ". Blocked now: ") + t.why : ". Nothing blocks training.");
}

function showLedger(rows, now) {
  const body = $("ledgerrows"); clear(body);
  for (const e of rows) {
    const tr = document.createElement("tr");
    cell(tr, e.node_id.slice(0, 12)); cell(tr, e.name); cell(tr, e.groups, "num");
    cell(tr, e.tokens.toLocaleString("en"), "num"); cell(tr, e.versions, "num"); cell(tr, ago(now, e.last_accepted_at));
    body.appendChild(tr);
  }
}

async function poll() {
  try {
    const [s, ov] = await Promise.all([get("/v1/status"), get("/v1/overview")]);
    showStatus(s, ov);
    showLedger((await get("/v1/ledger/nodes?limit=" + TOP_CONTRIBUTORS)).nodes, ov.now);
    $("err").textContent = "";
  } catch (e) {
    $("err").textContent = "cannot reach the coordinator: " + e.message;
  }
}
poll();
setInterval(poll, 3000);
</script></body></html>
"""
