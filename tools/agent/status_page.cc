// The node status page served at / by the agent: one self-contained HTML file
// (inline style and script, no external assets: nodes have no internet). It
// polls /api/status (status.h) every 2 s and draws the node's devices and
// containers with their limits, usage and state, and small plots of the
// agent's history (the last 10 minutes). Cells carry data-field attributes so
// that tests (test/agent/status_page_test.py, in headless Chromium) can read
// the numbers the page shows.
#include "status.h"

namespace gpuslice::agent {

const char* status_page_html() {
  return R"HTML(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>gpuslice node status</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #1d2330; background: #f6f7f9; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 20px 0 6px; }
  .sub { color: #5a6270; margin-bottom: 12px; }
  table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px #0002; }
  th, td { padding: 5px 9px; border-bottom: 1px solid #e3e6ea; text-align: right; white-space: nowrap; }
  th { background: #eef0f3; font-weight: 600; }
  td.l, th.l { text-align: left; }
  .bar { display: inline-block; width: 80px; height: 8px; background: #e3e6ea; vertical-align: middle; margin-left: 6px; }
  .bar > span { display: block; height: 8px; background: #3b7ddd; }
  .bar.full > span { background: #d9534f; }
  .held { color: #b35c00; font-weight: 600; }
  .warn { color: #c0392b; font-weight: 600; }
  svg { vertical-align: middle; }
  .legend { color: #5a6270; font-size: 12px; }
</style>
</head>
<body data-ready="0">
<h1>gpuslice on this node</h1>
<div class="sub" id="agent">loading…</div>
<h2>Devices</h2>
<table id="devices"><thead><tr><th class="l">GPU</th><th>SM utilisation</th><th>processes</th><th class="l">last 10 min</th></tr></thead><tbody></tbody></table>
<h2>Containers</h2>
<table id="containers"><thead><tr>
  <th class="l">container</th><th class="l">pod</th><th class="l">GPU</th><th>memory used / quota</th><th>spilled</th>
  <th>SM used / limit</th><th>priority</th><th>OOM refusals</th><th>processes</th><th>backstop</th>
  <th class="l">memory, last 10 min</th><th class="l">SM %, last 10 min</th></tr></thead><tbody></tbody></table>
<p class="legend">Plots: blue = used, grey dashes = quota or limit. Numbers are the agent's own /metrics.</p>
<script>
"use strict";
const units = ["B", "KiB", "MiB", "GiB", "TiB"];
function bytes(b) {
  if (b === undefined) return "–";
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i === 0 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
}
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function spark(points, limit, max) {
  const w = 160, h = 34, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const bg = document.createElementNS(ns, "rect");
  bg.setAttribute("width", w); bg.setAttribute("height", h); bg.setAttribute("fill", "#fff");
  bg.setAttribute("stroke", "#e3e6ea");
  svg.appendChild(bg);
  if (!points || points.t.length === 0) return svg;
  const t0 = points.t[0], t1 = Math.max(points.t[points.t.length - 1], t0 + 1);
  const top = Math.max(max || 0, limit || 0, ...points.v, 1e-9);
  const y = v => (h - 2 - (h - 4) * v / top).toFixed(1);
  const x = t => (2 + (w - 4) * (t - t0) / (t1 - t0)).toFixed(1);
  if (limit !== undefined) {
    const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", 0); l.setAttribute("x2", w); l.setAttribute("y1", y(limit)); l.setAttribute("y2", y(limit));
    l.setAttribute("stroke", "#8a919c"); l.setAttribute("stroke-dasharray", "4 3");
    svg.appendChild(l);
  }
  const p = document.createElementNS(ns, "polyline");
  p.setAttribute("points", points.t.map((t, i) => `${x(t)},${y(points.v[i])}`).join(" "));
  p.setAttribute("fill", "none"); p.setAttribute("stroke", "#3b7ddd"); p.setAttribute("stroke-width", "1.5");
  svg.appendChild(p);
  return svg;
}
function render(d) {
  const by = {};
  for (const s of d.series) (by[s.metric] = by[s.metric] || []).push(s);
  const one = m => (by[m] && by[m].length ? by[m][0].value : undefined);
  const hist = {};
  for (const s of d.history) {
    const key = s.metric + "|" + (s.labels.region || "") + "|" + (s.labels.device || "") + "|" + (s.labels.uuid || "");
    hist[key] = s;
  }
  const info = (by.gpuslice_agent_info || [])[0];
  document.getElementById("agent").textContent =
    `agent ${info ? info.labels.version : "?"} · ${one("gpuslice_agent_regions")} region(s) · ` +
    `NVML ${one("gpuslice_agent_nvml_available") ? "available" : "not available"} · ` +
    `cycle ${(1000 * (one("gpuslice_agent_cycle_seconds") || 0)).toFixed(2)} ms · ` +
    `${one("gpuslice_agent_invalid_files") || 0} invalid file(s) · ` +
    `${one("gpuslice_agent_regions_unwatched") || 0} unwatched (max ${one("gpuslice_agent_regions_max")}) · ` +
    `${new Date(d.time_ms).toLocaleTimeString()}`;

  const dev = document.querySelector("#devices tbody");
  dev.replaceChildren();
  for (const s of by.gpuslice_device_sm_utilization_ratio || []) {
    const uuid = s.labels.uuid;
    const procs = (by.gpuslice_device_processes || []).find(p => p.labels.uuid === uuid);
    const tr = el("tr", {"data-uuid": uuid});
    tr.appendChild(el("td", {class: "l"}, uuid));
    tr.appendChild(el("td", {"data-field": "device_sm_pct"}, (100 * s.value).toFixed(1) + " %"));
    tr.appendChild(el("td", {"data-field": "device_processes"}, procs ? procs.value : "–"));
    const td = el("td", {class: "l"});
    td.appendChild(spark(hist["gpuslice_device_sm_utilization_ratio|||" + uuid], undefined, 1));
    tr.appendChild(td);
    dev.appendChild(tr);
  }

  const field = (m, labels) => (by[m] || []).find(s => s.labels.region === labels.region &&
      (s.labels.device === undefined || s.labels.device === labels.device));
  const rows = document.querySelector("#containers tbody");
  rows.replaceChildren();
  const used = (by.gpuslice_memory_used_bytes || []).slice().sort((a, b) =>
      (a.labels.container + a.labels.region).localeCompare(b.labels.container + b.labels.region));
  for (const s of used) {
    const L = s.labels, key = `|${L.region}|${L.device}|${L.uuid}`;
    const quota = field("gpuslice_memory_quota_bytes", L);
    const spilled = field("gpuslice_memory_spilled_bytes", L);
    const util = field("gpuslice_sm_utilization_ratio", L);
    const limit = field("gpuslice_sm_limit_percent", L);
    const level = field("gpuslice_priority_level", L);
    const held = field("gpuslice_priority_held", L);
    const refusals = field("gpuslice_oom_refusals_total", L);
    const procs = field("gpuslice_container_processes", L);
    const tr = el("tr", {"data-container": L.container || L.region, "data-device": L.device});
    tr.appendChild(el("td", {class: "l", "data-field": "container"}, L.container || "(unnamed)"));
    const pod = L.pod_uid || L.claim_uid || L.region;
    tr.appendChild(el("td", {class: "l", "data-field": "pod_uid", "data-value": pod, title: pod},
                      pod.length > 13 ? pod.slice(0, 8) + "…" : pod));
    tr.appendChild(el("td", {class: "l"}, L.uuid.slice(0, 12)));
    const mem = el("td", {"data-field": "memory", "data-used": s.value, "data-quota": quota ? quota.value : ""},
                   `${bytes(s.value)} / ${quota ? bytes(quota.value) : "unlimited"}`);
    if (quota) {
      const frac = Math.min(1, s.value / quota.value);
      const bar = el("span", {class: "bar" + (frac > 0.95 ? " full" : "")});
      bar.appendChild(el("span", {style: `width:${(100 * frac).toFixed(0)}%`}));
      mem.appendChild(bar);
    }
    tr.appendChild(mem);
    tr.appendChild(el("td", {"data-field": "spilled", "data-value": spilled ? spilled.value : 0},
                      spilled && spilled.value > 0 ? bytes(spilled.value) : "–"));
    tr.appendChild(el("td", {"data-field": "sm", "data-limit": limit ? limit.value : ""},
                      `${util ? (100 * util.value).toFixed(1) : "–"} % / ${limit && limit.value < 100 ? limit.value + " %" : "unlimited"}`));
    const names = {1: "low", 2: "normal", 3: "high"};
    const pr = el("td", {"data-field": "priority"}, (level ? names[level.value] : "normal") + (held && held.value ? " (held)" : ""));
    if (held && held.value) pr.className = "held";
    tr.appendChild(pr);
    const oom = el("td", {"data-field": "oom_refusals"}, refusals ? refusals.value : 0);
    if (refusals && refusals.value > 0) oom.className = "warn";
    tr.appendChild(oom);
    tr.appendChild(el("td", {"data-field": "processes"}, procs ? procs.value : "–"));
    const wall = field("gpuslice_memory_backstop", L);
    const bs = el("td", {"data-field": "backstop"}, wall ? wall.labels.kind : "–");
    if (wall && wall.labels.kind === "none") bs.className = "warn";
    tr.appendChild(bs);
    const m = el("td", {class: "l"});
    m.appendChild(spark(hist["gpuslice_memory_used_bytes" + key], quota ? quota.value : undefined));
    tr.appendChild(m);
    const c = el("td", {class: "l"});
    const u = hist["gpuslice_sm_utilization_ratio" + key];
    c.appendChild(spark(u ? {t: u.t, v: u.v.map(v => 100 * v)} : undefined, limit ? limit.value : undefined, 100));
    tr.appendChild(c);
    rows.appendChild(tr);
  }
  document.body.setAttribute("data-ready", "1");
}
async function refresh() {
  try {
    const r = await fetch("api/status", {cache: "no-store"});
    render(await r.json());
  } catch (e) {
    document.getElementById("agent").textContent = "cannot reach the agent: " + e;
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
)HTML";
}

}  // namespace gpuslice::agent
