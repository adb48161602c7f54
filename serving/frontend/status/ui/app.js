// shardserve status page + QA playground (serving/frontend/status/ui/index.html).
// Polls ./ui/status every POLL_MS (serving/frontend/status/board.py: the same registry as /metrics) and renders it;
// the playground posts to ./v1/qa. Text from the server is set with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

// A number, or a dash that says it is not measured (never a made-up zero).
function num(v, digits = 1, unit = "") {
  if (v === null || v === undefined) return el("span", { class: "na", title: "not measured" }, "—");
  return document.createTextNode(Number(v).toFixed(digits) + unit);
}

function pct(v) {
  if (v === null || v === undefined) return el("span", { class: "na", title: "not measured" }, "—");
  const width = Math.round(Math.max(0, Math.min(1, v)) * 60);
  const frag = document.createDocumentFragment();
  const bar = el("span", { class: "bar" });
  bar.style.width = `${width}px`;
  frag.append(bar, `${(100 * v).toFixed(1)} %`);
  return frag;
}

// "p50 / p95 / p99 ms", a dash for each percentile not measured (no request in the window)
function percentiles(p) {
  const frag = document.createDocumentFragment();
  ["p50", "p95", "p99"].forEach((k, i) => {
    if (i) frag.append(" / ");
    frag.append(num(p[k], 1));
  });
  frag.append(" ms");
  return frag;
}

function duration(s) {
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function facts(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, v));
}

function rows(tbody, data, cells) {
  tbody.replaceChildren(...data.map((d, i) => el("tr", {}, ...cells(d, i).map((c) => el("td", {}, c)))));
}

function badge(state) {
  return el("span", { class: "badge", "data-state": state }, state);
}

// ------------------------------------------------------------------------------ status sections

function renderModel(s) {
  const m = s.model;
  const plan = s.plan;
  const arch = m.arch ? `${m.arch}, ${m.layers} layers, hidden ${m.hidden_size}, ${m.heads} heads` : "—";
  facts($("model"), [
    ["model", m.name + (m.generation !== undefined ? ` (generation ${m.generation})` : "")],
    ["architecture", arch],
    ["checkpoint", m.checkpoint || "—"],
    ["precision", `${s.precision.dtype} on ${s.precision.device} (${s.precision.reason})`],
    ["partition", plan ? `pp=${plan.pp} × tp=${plan.tp} = ${plan.world_size} rank(s) per gang, cost model: ${plan.cost_source}` : "starting"],
  ]);
  rows($("plan").tBodies[0], plan ? plan.stages : [], (st) => [
    String(st.index),
    `${st.layer_start}–${st.layer_end - 1} (${st.layer_end - st.layer_start})`,
    st.ranks.join(", "),
    [st.has_embeddings ? "embeddings" : "", st.has_head ? "QA head" : ""].filter(Boolean).join(" + ") || "—",
    st.params_per_rank.toLocaleString(),
    `${(100 * st.cost_share).toFixed(1)} %`,
  ]);
}

function renderModels(s) {
  const ms = (v) => (v === null || v === undefined ? "—" : `${v.toFixed(1)} ms`);
  rows($("models").tBodies[0], s.models, (m) => [
    m.name,
    badge(m.state),
    m.checkpoint || "—",
    m.generation === null ? "—" : String(m.generation),
    String(m.ready_replicas),
    m.answered_per_s.toFixed(2),
    `${ms(m.latency_ms.p50)} / ${ms(m.latency_ms.p99)}`,
    String(m.queue_depth),
    String(m.ongoing_requests),
    m.reason,
  ]);
}

function renderPlacement(s) {
  const p = s.placement;
  $("placement-section").hidden = !p;
  if (!p) return;
  const pred = p.prediction ? `predicted SLO attainment ${(100 * p.prediction.attainment).toFixed(1)} %` : "";
  const unplaced = Object.entries(p.unplaced).map(([m, why]) => `${m}: ${why}`);
  $("placement-summary").textContent =
    `${p.policy} over ${p.devices} devices of ${(p.device_memory_bytes / 2 ** 20).toFixed(0)} MiB · ${pred}` +
    (unplaced.length ? ` · ${unplaced.join("; ")}` : "");
  rows($("placement").tBodies[0], p.groups, (g, i) => [
    String(i),
    g.devices.join(", "),
    `${g.pp} × ${g.tp}`,
    g.models.join(", ") || "—",
    g.gang ? `${g.gang} ${g.running ? "(running)" : "(starting)"}` : "—",
  ]);
  const last = p.history[p.history.length - 1];
  const searched = p.searches && p.searches.count
    ? ` · ${p.searches.count} searches since the start, ${p.searches.seconds.toFixed(2)} s in all`
    : "";
  $("placement-history").textContent = last
    ? `last change ${clock(last.time)}: ${last.reason || "at start"} → ${last.placement}${searched}`
    : "";
}

function renderReplicas(s) {
  const counts = Object.entries(s.replica_counts).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k}`);
  $("replica-summary").textContent =
    `${counts.join(", ") || "no gangs"} · failures ${s.replica_failures} · restarts ${s.replica_restarts} (all gangs)` +
    ` · windows retried ${s.retried_windows}`;
  rows($("replicas").tBodies[0], s.replicas, (r) => [
    r.id,
    r.model,
    badge(r.state),
    r.hosts.length ? r.hosts.join(", ") : el("span", { class: "na", title: "no rank heard from yet" }, "—"),
    ranksOf(r),
    String(r.restarts) + (r.replaces ? ` (replaces ${r.replaces})` : ""),
    String(r.inflight_batches),
    duration(r.age_s),
    r.error || "",
  ]);
}

function renderApiWorkers(s) {
  const ws = s.api_workers || [];
  $("api-section").hidden = ws.length === 0;
  rows($("api-workers").tBodies[0], ws, (w) => [
    String(w.index),
    w.pid === null ? "—" : String(w.pid),
    badge(!w.alive ? "restarting" : w.connected ? "ready" : "starting"),
    String(w.restarts),
  ]);
}

// One line per rank: "1 (1/0): pid 4242 · cpu", with its host when the gang spans several hosts.
// Host and pid are what the rank reports in its heartbeats; "not heard yet" before its first one.
function ranksOf(r) {
  const frag = document.createDocumentFragment();
  r.ranks.forEach((k, i) => {
    if (i) frag.append(el("br"));
    const where = k.pid === null ? "not heard yet" : `pid ${k.pid}` + (r.hosts.length > 1 ? ` on ${k.host}` : "");
    frag.append(`${k.rank} (${k.stage}/${k.tp_rank}): ${where} · ${k.device ?? "—"}`);
  });
  return frag;
}

function renderTraffic(s) {
  const q = s.queue;
  facts($("queue"), [
    ["queue depth", `${q.depth_requests} request(s), ${q.depth_windows} window(s) (max ${q.max_queue_size} requests)`],
    ["ongoing requests", String(q.ongoing_requests)],
    ["padding", `${(100 * q.padding_ratio).toFixed(1)} % of padded tokens`],
  ]);
  rows($("windows").tBodies[0], s.windows, (w) => [
    `${w.window_s >= 60 ? `${w.window_s / 60} min` : `${w.window_s} s`}` +
      (w.covered_s + 1 < w.window_s ? ` (${duration(w.covered_s)} so far)` : ""),
    String(w.requests),
    num(w.answered_per_s, 2),
    num(w.windows_per_s, 2),
    percentiles(w.latency_ms),
    num(w.queue_wait_ms.p95, 1, " ms"),
    num(w.mean_batch_windows, 2),
    pct(w.context_cache_hits),
    Object.entries(w.error_responses).map(([k, n]) => `${n}× ${k}`).join(", ") || "none",
  ]);
  chart("queue", s.series, (p) => p.queue_depth);
  chart("rps", s.series, (p) => p.answered_per_s);
  chart("latency", s.series, (p) => p.mean_latency_ms);
}

function chart(name, series, pick) {
  const svg = $(`chart-${name}`);
  const pts = series.map((p) => [p.t, pick(p)]).filter(([, v]) => v !== null && v !== undefined);
  svg.replaceChildren();
  const axis = $(`axis-${name}`);
  if (pts.length < 2) {
    axis.replaceChildren(el("span", {}, "no data yet"));
    return;
  }
  const t0 = pts[0][0], t1 = pts[pts.length - 1][0];
  const top = Math.max(...pts.map(([, v]) => v)) || 1;
  const coords = pts.map(([t, v]) => `${(300 * (t - t0)) / Math.max(t1 - t0, 1e-9)},${78 - (74 * v) / top}`);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", coords.join(" "));
  svg.append(line);
  axis.replaceChildren(el("span", {}, `−${duration(t1 - t0)}`), el("span", {}, `max ${top.toFixed(top < 10 ? 2 : 0)}`), el("span", {}, "now"));
}

function renderStages(s) {
  const list = [];
  for (const r of s.replicas) for (const st of r.stages) list.push([r, st]);
  rows($("stages").tBodies[0], list, ([r, st]) => [
    r.id,
    String(st.stage),
    num(st.busy_s, 2),
    pct(st.busy_fraction_recent),
    st.stage === 0 ? pct(r.bubble_fraction) : "",
  ]);
}

function renderAutoscaler(s) {
  const a = s.autoscaler;
  if (!a) {
    facts($("autoscaler"), [["state", "starting"]]);
    $("decisions").replaceChildren();
    return;
  }
  facts($("autoscaler"), [
    ["target", `${a.target} gang(s)`],
    ["mode", a.autoscaling ? `autoscaling between ${a.min_replicas} and ${a.max_replicas}` : `pinned at ${a.pinned}`],
    ["device pool fits", `${a.pool_limit} gang(s)`],
    ["target load", `${a.target_ongoing_requests} ongoing request(s) per gang`],
    ["decisions", `${a.decisions.up || 0} up, ${a.decisions.down || 0} down`],
    ["last decision", a.last_decision],
  ]);
  const recent = a.recent.slice().reverse().map((d) =>
    el("li", {}, el("span", { class: "when" }, clock(d.time)), `${d.source}: ${d.before} → ${d.after} · ${d.reason}`));
  $("decisions").replaceChildren(...(recent.length ? recent : [el("li", { class: "muted" }, "no target change yet")]));
}

function renderErrors(s) {
  $("last-failure").textContent = s.last_failure ? `last gang failure: ${s.last_failure}` : "no gang failure";
  const items = s.recent_errors.map((e) =>
    el("li", {}, el("span", { class: "when" }, clock(e.time)), el("span", { class: `lvl-${e.level}` }, e.level),
      ` ${e.logger}: ${e.message}`));
  $("errors").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "none")]));
}

let apiKeyRequired = false;

function render(s) {
  $("state").textContent = s.state;
  $("state").dataset.state = s.state;
  $("model-name").textContent = `${s.model.name} · up ${duration(s.uptime_s)}`;
  $("updated").textContent = `updated ${clock(s.time)}`;
  apiKeyRequired = s.api_key_required;
  $("api-key-row").hidden = !apiKeyRequired && !$("api-key").value;
  renderModel(s);
  renderModels(s);
  renderPlacement(s);
  renderReplicas(s);
  renderApiWorkers(s);
  renderTraffic(s);
  renderStages(s);
  renderAutoscaler(s);
  renderErrors(s);
}

async function poll() {
  try {
    const r = await fetch("ui/status", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (err) {
    $("state").textContent = "offline";
    $("state").dataset.state = "offline";
    $("updated").textContent = `cannot reach the server (${err.message})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ------------------------------------------------------------------------------ playground

// The context with each answer's span marked; where spans overlap, the better-ranked answer wins.
function highlight(text, answers) {
  // the server's offsets count code points (Python str); a JS string counts UTF-16 units, so an
  // emoji would shift every mark after it: work on the code points
  const context = Array.from(text);
  const owner = new Array(context.length).fill(0);
  answers.forEach((a, i) => {
    for (let c = a.start; c < a.end; c++) if (!owner[c]) owner[c] = i + 1;
  });
  const out = $("highlighted");
  out.replaceChildren();
  let i = 0;
  while (i < context.length) {
    let j = i;
    while (j < context.length && owner[j] === owner[i]) j++;
    const part = context.slice(i, j).join("");
    if (owner[i]) {
      const a = answers[owner[i] - 1];
      out.append(el("mark", { class: `rank-${owner[i]}`, title: `#${owner[i]} score ${a.score.toFixed(4)}` }, part));
    } else {
      out.append(part);
    }
    i = j;
  }
}

async function ask(event) {
  event.preventDefault();
  const context = $("context").value;
  const body = { question: $("question").value, context, top_k: Number($("top-k").value) || 1 };
  const headers = { "content-type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.authorization = `Bearer ${key}`;
  $("ask").disabled = true;
  $("qa-error").hidden = true;
  const t0 = performance.now();
  try {
    const r = await fetch("v1/qa", { method: "POST", headers, body: JSON.stringify(body) });
    const roundTrip = performance.now() - t0;
    const data = await r.json().catch(() => ({}));
    if (!r.ok) {
      const why = r.status === 401 ? "the server needs its API key (field above)" : data.detail || data.error;
      throw new Error(`HTTP ${r.status}: ${typeof why === "string" ? why : JSON.stringify(why)}`);
    }
    $("qa-meta").textContent =
      `${data.windows} window(s) · ${data.latency_ms.toFixed(1)} ms on the server, ${roundTrip.toFixed(1)} ms round trip` +
      (data.no_answer ? " · no answer (null_score_diff above the threshold)" : "") + ` · ${data.model}`;
    highlight(context, data.answers);
    rows($("answers").tBodies[0], data.answers, (a) => {
      const i = data.answers.indexOf(a) + 1;
      return [String(i), el("mark", { class: `rank-${i}` }, a.text), a.score.toFixed(4), `${a.start}–${a.end}`];
    });
    $("qa-result").hidden = false;
  } catch (err) {
    $("qa-error").textContent = err.message;
    $("qa-error").hidden = false;
  } finally {
    $("ask").disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("qa-form").addEventListener("submit", ask);
  poll();
});
