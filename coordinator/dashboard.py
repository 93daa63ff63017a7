"""The dashboard: one self-contained HTML page (no CDN) that polls /v1/status every 2 s.

It shows the run, the current version, the first page of nodes (banned or gone ones marked; with their
self-reported idle and busy seconds), the group counters, and line charts (inline SVG) of the trainer's accuracy
and reward metrics and of the nodes' idle share (`node_idle_frac`) over steps. Every value from the server is
inserted as text, never as HTML: node names come from untrusted nodes.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>swarmrl coordinator</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
 .muted { color: #777; } .err { color: #b00; }
 .cards { display: flex; gap: 1em; flex-wrap: wrap; }
 .card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .6em 1em; min-width: 8em; }
 .card b { display: block; font-size: 1.5em; }
 table { border-collapse: collapse; background: #fff; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
 th { background: #f0f0f0; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
 tr.banned td { color: #b00; }
 .charts { display: flex; gap: 1.5em; flex-wrap: wrap; }
 svg { background: #fff; border: 1px solid #ddd; border-radius: 6px; }
</style></head><body>
<h1>swarmrl coordinator <span id="run" class="muted"></span></h1>
<div id="err" class="err"></div>
<div class="cards">
 <div class="card">version<b id="version">-</b></div>
 <div class="card">pending<b id="pending">-</b></div>
 <div class="card">accepted<b id="accepted">-</b></div>
 <div class="card">rejected<b id="rejected">-</b></div>
 <div class="card">nodes<b id="nnodes">-</b></div>
</div>
<h2>Training</h2>
<div class="charts"><div><div id="acc-title">accuracy</div><svg id="acc" width="460" height="220"></svg></div>
<div><div id="rew-title">reward</div><svg id="rew" width="460" height="220"></svg></div>
<div><div id="idle-title">node idle share since the previous step</div>
<svg id="idle" width="460" height="220"></svg></div></div>
<h2>Nodes</h2>
<table><thead><tr><th>node</th><th>name</th><th>engine</th><th>version</th><th>accepted</th><th>rejected</th>
<th>state</th><th>idle s</th><th>busy s</th><th>idle %</th><th>last seen</th></tr></thead>
<tbody id="nodes"></tbody></table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"];

function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function chart(svg, series) {
  // series: {name: [[step, value], ...]}; drawn on shared axes.
  while (svg.firstChild) svg.removeChild(svg.firstChild);
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
    svg.appendChild(el("polyline", {fill: "none", stroke: c, "stroke-width": 1.5,
                                    points: data.map(p => sx(p[0]) + "," + sy(p[1])).join(" ")}));
    svg.appendChild(el("text", {x: L + 6, y: T + 12 + 12 * i, "font-size": 11, fill: c}, name));
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

function ago(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return s.toFixed(0) + " s ago";
  return s < 5400 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
}

async function poll() {
  try {
    const r = await fetch("/v1/status", {cache: "no-store"});
    if (!r.ok) throw new Error("status " + r.status);
    const s = await r.json();
    $("err").textContent = "";
    const spec = s.run.spec;
    $("run").textContent = [spec.run_id, spec.task.name, "group size " + spec.sampling.group_size].join(" \\u00b7 ");
    $("version").textContent = s.run.current_version;
    $("pending").textContent = s.groups_pending;
    $("accepted").textContent = s.groups_accepted;
    $("rejected").textContent = s.groups_rejected;
    $("nnodes").textContent = s.nodes_total + (s.nodes_gone ? " (" + s.nodes_gone + " gone)" : "");
    const body = $("nodes"); body.textContent = "";
    for (const n of s.nodes) {
      const tr = document.createElement("tr"); if (n.banned) tr.className = "banned";
      cell(tr, n.node_id.slice(0, 12)); cell(tr, n.name); cell(tr, n.engine); cell(tr, n.held_version, "num");
      cell(tr, n.groups_accepted, "num"); cell(tr, n.groups_rejected, "num");
      cell(tr, n.banned ? "banned" : (n.gone_since ? "gone" : ""));
      const spent = n.idle_s + n.busy_s;
      cell(tr, n.idle_s.toFixed(0), "num"); cell(tr, n.busy_s.toFixed(0), "num");
      cell(tr, spent > 0 ? (100 * n.idle_s / spent).toFixed(0) : "", "num");
      cell(tr, ago(n.last_seen)); body.appendChild(tr);
    }
    chart($("acc"), seriesMatching(s.metrics, /acc/i));
    chart($("rew"), seriesMatching(s.metrics, /reward/i));
    chart($("idle"), seriesMatching(s.metrics, /^node_idle_frac$/));
  } catch (e) {
    $("err").textContent = "cannot reach the coordinator: " + e.message;
  }
}
poll();
setInterval(poll, 2000);
</script></body></html>
"""
