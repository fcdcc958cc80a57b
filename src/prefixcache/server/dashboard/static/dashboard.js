// The live dashboard: polls /dashboard/data once a second, keeps the last HISTORY samples and
// draws them with uPlot. Rates and the hit ratio per interval come from the differences of the
// server's cumulative counters between two samples; every figure shown is the server's own.
"use strict";

const HISTORY = 300;
const POLL_MS = 1000;
const COLORS = ["#3b6fd8", "#f0a23b", "#8a94a3", "#2e9e6b", "#c94f7c", "#7b5cd6"];
const samples = [];
const charts = {};
window.dashboard = {polls: 0, last: null};  // what the page last showed (tests read it)

function el(id) { return document.getElementById(id); }
function fmt(n) { return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en"); }
function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
function secs(x) { return x === null || x === undefined ? "–" : x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s"; }

function chart(id, series) {
  const target = el(id);
  const opts = {
    width: Math.max(target.clientWidth, 360), height: 170,
    scales: {x: {time: true}}, legend: {live: false},
    series: [{}].concat(series.map((label, i) => ({label, stroke: COLORS[i], width: 1.5}))),
    axes: [{}, {size: 60}],
  };
  const empty = [[]].concat(series.map(() => []));
  charts[id] = new uPlot(opts, empty, target);
}

function rate(now, before, key) {
  const dt = now.time - before.time;
  return dt > 0 ? Math.max(now.counters[key] - before.counters[key], 0) / dt : 0;
}

function redraw() {
  const xs = samples.map((s) => s.time);
  const pairs = samples.map((s, i) => [s, samples[Math.max(i - 1, 0)]]);
  charts["chart-pool"].setData([xs, samples.map((s) => s.pool.used),
    samples.map((s) => s.pool.cached_free), samples.map((s) => s.pool.free)]);
  charts["chart-hit"].setData([xs, pairs.map(([s, b]) => {
    const q = s.counters.prefix_cache_queries - b.counters.prefix_cache_queries;
    return q > 0 ? (s.counters.prefix_cache_hits - b.counters.prefix_cache_hits) / q : null;
  })]);
  charts["chart-saved"].setData([xs, pairs.map(([s, b]) => rate(s, b, "prefix_cache_hits"))]);
  charts["chart-churn"].setData([xs, pairs.map(([s, b]) => rate(s, b, "evictions")),
    pairs.map(([s, b]) => rate(s, b, "preemptions"))]);
  charts["chart-queue"].setData([xs, samples.map((s) => s.requests.running),
    samples.map((s) => s.requests.waiting)]);
}

function cards(d) {
  const p = d.pool;
  el("model").textContent = d.model + (d.kv_cache_dtype ? " · KV " + d.kv_cache_dtype : "") +
    " · step " + fmt(d.step);
  el("pool-used").textContent = fmt(p.used);
  el("pool-cached").textContent = fmt(p.cached_free);
  el("pool-free").textContent = fmt(p.free);
  el("pool-pinned").textContent = fmt(p.pinned);
  el("pool-blocks").textContent = fmt(p.blocks);
  const bar = el("pool-bar").children;
  [p.used, p.cached_free, p.free].forEach((n, i) => { bar[i].style.width = (100 * n / p.blocks) + "%"; });
  const c = d.counters;
  el("hit-ratio").textContent = pct(c.prefix_cache_queries ? c.prefix_cache_hits / c.prefix_cache_queries : null);
  el("hits-total").textContent = fmt(c.prefix_cache_hits);
  el("queries-total").textContent = fmt(c.prefix_cache_queries);
  el("evictions-total").textContent = fmt(c.evictions);
  el("preemptions-total").textContent = fmt(c.preemptions);
  el("finished").textContent = fmt(c.requests_finished);
  const before = samples.length > 1 ? samples[samples.length - 2] : null;
  el("saved-rate").textContent = before ? fmt(rate(d, before, "prefix_cache_hits")) : "–";
  el("running").textContent = fmt(d.requests.running);
  el("waiting").textContent = fmt(d.requests.waiting);
  el("queued").textContent = fmt(d.requests.queued_http);
}

const drawn = {};  // what each table and the tree last drew: unchanged data is not redrawn
function changed(key, value) {
  const text = JSON.stringify(value);
  if (drawn[key] === text) return false;
  drawn[key] = text;
  return true;
}

function rows(tableId, items, cells) {
  if (!changed(tableId, items)) return;
  const body = el(tableId).tBodies[0];
  body.replaceChildren(...items.map((item) => {
    const tr = document.createElement("tr");
    for (const value of cells(item)) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    return tr;
  }));
}

// diagnosed misses by reason, most first ("none": diagnosed hits, left out)
function reasons(counts) {
  const misses = Object.entries(counts).filter(([r, n]) => r !== "none" && n > 0);
  misses.sort((a, b) => b[1] - a[1]);
  return misses.map(([r, n]) => `${r} ${fmt(n)}`).join(" ") || "–";
}

// per medium: the router's belief / the replica's truth (drift, where both are known)
function media(byMedium) {
  return Object.entries(byMedium).map(([m, x]) => `${m} ${fmt(x.believes)}/${fmt(x.holds)}` +
    (x.drift === null || x.drift === undefined ? "" : ` (${x.drift > 0 ? "+" : ""}${x.drift})`))
    .join(" · ") || "–";
}

function tables(d) {
  rows("domains", d.domains, (x) => [x.domain || "(single tenant)", pct(x.hit_ratio),
    fmt(x.queried_tokens), secs(x.ttft_p50_s), secs(x.ttft_p99_s), fmt(x.requests),
    reasons(x.miss_reasons || {})]);
  rows("recent", d.recent.slice(0, 15), (x) => [new Date(x.t * 1000).toLocaleTimeString(), x.domain || "–",
    fmt(x.prompt_tokens), fmt(x.cached_tokens), fmt(x.first_miss_block), x.reason]);
  const replicas = d.cluster ? d.cluster.replicas : [];
  el("cluster-box").hidden = replicas.length === 0;
  rows("cluster", replicas, (r) => [r.replica, r.slot === null ? "–" : r.slot,
    fmt(r.router_believes), fmt(r.replica_holds), media(r.by_medium || {}), pct(r.hit_ratio),
    fmt(r.in_flight), fmt(r.running)]);
  const tiers = Object.entries(d.tiers);
  el("tiers-box").hidden = tiers.length === 0;
  rows("tiers", tiers, ([name, t]) => [name, t.up ? "yes" : "no", fmt(t.blocks_held),
    t.capacity_bytes ? pct(t.bytes_held / t.capacity_bytes) : "–", fmt(t.hits), fmt(t.misses),
    fmt(t.blocks_written), fmt(t.evicted), fmt(t.quarantined)]);
}

// an icicle: each segment a rectangle at its first block, one row per level of branching
function tree(d) {
  if (!changed("tree", [d.tree, d.domains.map((x) => x.domain)])) return;
  const svg = el("tree");
  const ns = "http://www.w3.org/2000/svg";
  const width = svg.clientWidth || 900;
  const domains = [...new Set(d.domains.map((x) => x.domain))];
  let maxBlock = 1;
  let levels = 1;
  const walk = (seg, level) => {
    maxBlock = Math.max(maxBlock, seg.start_block + seg.blocks);
    levels = Math.max(levels, level + 1);
    seg.children.forEach((c) => walk(c, level + 1));
  };
  d.tree.forEach((root) => walk(root, 0));
  const rowsPerRoot = levels;
  const rowH = 20;
  const height = Math.max(60, d.tree.length * rowsPerRoot * rowH + 10);
  svg.style.height = height + "px";
  svg.replaceChildren();
  const scale = (width - 20) / maxBlock;
  let offset = 0;
  const draw = (seg, level, base) => {
    const rect = document.createElementNS(ns, "rect");
    const x = 10 + seg.start_block * scale;
    const y = base + level * rowH;
    const w = Math.max(seg.blocks * scale - 1, 2);
    rect.setAttribute("x", x); rect.setAttribute("y", y);
    rect.setAttribute("width", w); rect.setAttribute("height", rowH - 2);
    rect.setAttribute("fill", COLORS[Math.max(domains.indexOf(seg.domain), 0) % COLORS.length]);
    rect.setAttribute("data-digest", seg.digest);
    const title = document.createElementNS(ns, "title");
    title.textContent = `${seg.digest}… blocks ${seg.start_block}–${seg.start_block + seg.blocks - 1}` +
      ` · ${seg.requests} requests · ${seg.live} live · ${seg.domain || "single tenant"}`;
    rect.appendChild(title);
    svg.appendChild(rect);
    if (w > 60) {
      const text = document.createElementNS(ns, "text");
      text.setAttribute("x", x + 4); text.setAttribute("y", y + 13);
      text.textContent = `${seg.requests} · ${seg.live}`;
      svg.appendChild(text);
    }
    seg.children.forEach((c) => draw(c, level + 1, base));
  };
  d.tree.forEach((root) => { draw(root, 0, 5 + offset); offset += rowsPerRoot * rowH; });
}

async function poll() {
  try {
    const reply = await fetch("/dashboard/data", {credentials: "same-origin", cache: "no-store"});
    if (reply.status === 401) { location.reload(); return; }
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    const d = await reply.json();
    samples.push(d);
    if (samples.length > HISTORY) samples.shift();
    cards(d); tables(d); tree(d); redraw();
    window.dashboard.polls += 1;
    window.dashboard.last = d;
    el("status").textContent = "live · " + new Date(d.time * 1000).toLocaleTimeString();
  } catch (err) {
    el("status").textContent = "disconnected: " + err.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

chart("chart-pool", ["used", "cached free", "free"]);
chart("chart-hit", ["hit ratio"]);
chart("chart-saved", ["tokens/s"]);
chart("chart-churn", ["evictions/s", "preemptions/s"]);
chart("chart-queue", ["running", "waiting"]);
el("logout").addEventListener("click", async () => {
  await fetch("/dashboard/logout", {method: "POST", credentials: "same-origin"});
  location.reload();
});
poll();
