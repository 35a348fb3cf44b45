// The gateway's live dashboard: polls /admin/backends and /metrics (both behind the admin key when keys are
// on) and renders them; rates and windowed percentiles are the differences between two polls.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120;
const KEY_ITEM = "heterogate-admin-key";

let previous = null;          // {t, metrics} of the last poll
const rpsHistory = [];
// counter series (totals, histogram buckets) of backends that left the fleet: their series leave /metrics,
// and the totals summed over them would go back (a removed backend's requests still happened)
const departed = new Map();
const COUNTER = /_(total|bucket|count|sum)$/;
const seriesKey = (s) => s.name + JSON.stringify(Object.entries(s.labels).sort());

function withDeparted(samples) {
  // `samples` with the counter series that were in the last poll and are gone now, at their last value
  if (previous) {
    const present = new Set(samples.map(seriesKey));
    for (const s of previous.metrics) {
      const key = seriesKey(s);
      if (COUNTER.test(s.name) && !present.has(key)) departed.set(key, s);
    }
  }
  return departed.size ? [...samples, ...departed.values()] : samples;
}

function parseMetrics(text) {
  // Prometheus text format: name{label="value",...} number
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    samples.push({name: m[1], labels, value: Number(m[4])});
  }
  return samples;
}

function sum(samples, name, by) {
  const out = new Map();
  for (const s of samples) {
    if (s.name !== name) continue;
    const key = by ? by(s.labels) : "";
    out.set(key, (out.get(key) || 0) + s.value);
  }
  return out;
}

function buckets(samples, name) {
  // cumulative bucket counts summed over every label set but `le`
  const out = new Map();
  for (const s of samples) if (s.name === name + "_bucket") out.set(s.labels.le, (out.get(s.labels.le) || 0) + s.value);
  return [...out.entries()].map(([le, n]) => [le === "+Inf" ? Infinity : Number(le), n]).sort((a, b) => a[0] - b[0]);
}

function quantile(cumulative, q) {
  // linear interpolation inside the bucket, as Prometheus' histogram_quantile does
  const total = cumulative.length ? cumulative[cumulative.length - 1][1] : 0;
  if (!total) return null;
  const rank = q * total;
  let lower = 0, below = 0;
  for (const [le, n] of cumulative) {
    if (n >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * (n - below > 0 ? (rank - below) / (n - below) : 0);
    }
    lower = le; below = n;
  }
  return lower;
}

function windowed(now, before) {
  // bucket counts of the last interval when there were requests in it ([counts, true]), else since start
  if (!before) return [now, false];
  const prev = new Map(before);
  const delta = now.map(([le, n]) => [le, n - (prev.get(le) || 0)]);
  return delta.length && delta[delta.length - 1][1] > 0 ? [delta, true] : [now, false];
}

const seconds = (v) => v == null ? "–" : v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`;

function prefixHits(cache) {
  // the engine's reported prefix-cache hit rate where it reports one, else the index's prediction
  if (!cache) return "–";
  if (cache.reported_hit_rate != null) return `${(100 * cache.reported_hit_rate).toFixed(0)}%`;
  return cache.predicted_hit_rate == null ? "–" : `${(100 * cache.predicted_hit_rate).toFixed(0)}% (predicted)`;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

function renderBackends(backends, metrics, rates) {
  const restarts = sum(metrics, "heterogate_backend_restarts_total", (l) => l.backend);
  const body = document.querySelector("#backends tbody");
  body.replaceChildren();
  for (const b of backends) {
    const tr = document.createElement("tr");
    tr.dataset.backend = b.id;
    // A drained backend takes no new requests on purpose (a managed engine then stops): not shown as down.
    // reachable: an upstream that answers its probe without fresh load figures; it serves.
    tr.className = b.draining ? "draining" : b.healthy ? "healthy" : b.state === "reachable" ? "reachable" : "down";
    const kvUsed = b.kv_total_bytes ? 1 - b.kv_free_bytes / b.kv_total_bytes : 0;
    const speed = b.learned_speed || {};
    cell(tr, b.id);
    cell(tr, b.role);
    cell(tr, b.gpu);
    cell(tr, (b.models || []).join(", "));
    cell(tr, b.draining ? (b.state === "stopped" ? "drained" : `draining (${b.state})`) : b.state, "state");
    cell(tr, b.breaker, b.breaker === "closed" ? "breaker" : "breaker breaker-open");
    cell(tr, String(b.queue_depth));
    cell(tr, String(b.in_flight));
    cell(tr, `${(100 * kvUsed).toFixed(0)}%`);
    cell(tr, prefixHits(b.prefix_cache));
    cell(tr, speed.prefill_s_per_token == null ? "–" : (speed.prefill_s_per_token * 1e6).toFixed(1));
    cell(tr, speed.decode_step_s == null ? "–" : (speed.decode_step_s * 1e3).toFixed(2));
    cell(tr, b.min_priority == null ? "all" : `class ≥ ${b.min_priority}`);
    cell(tr, String(restarts.get(b.id) || 0), "restarts");
    cell(tr, (rates.get(b.id) || 0).toFixed(1));
    body.appendChild(tr);
  }
}

function renderTable(selector, rows) {
  const body = document.querySelector(selector + " tbody");
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const v of row) cell(tr, v);
    body.appendChild(tr);
  }
}

function drawHistory() {
  const canvas = document.getElementById("rps-chart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(1, ...rpsHistory);
  ctx.strokeStyle = "#1565c0";
  ctx.beginPath();
  rpsHistory.forEach((v, i) => {
    const x = canvas.width - (rpsHistory.length - 1 - i) * (canvas.width / (HISTORY - 1));
    const y = canvas.height - 2 - (v / top) * (canvas.height - 4);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function render(backends, metrics, t) {
  const requests = sum(metrics, "heterogate_requests_total", (l) => l.backend);
  const total = [...requests.values()].reduce((a, b) => a + b, 0);
  const rates = new Map();
  let rps = 0;
  if (previous) {
    const dt = (t - previous.t) / 1000;
    const before = sum(previous.metrics, "heterogate_requests_total", (l) => l.backend);
    for (const [id, n] of requests) rates.set(id, Math.max(0, n - (before.get(id) || 0)) / dt);
    rps = Math.max(0, total - [...before.values()].reduce((a, b) => a + b, 0)) / dt;
  }
  rpsHistory.push(rps);
  if (rpsHistory.length > HISTORY) rpsHistory.shift();
  document.getElementById("rps").textContent = rps.toFixed(1);
  drawHistory();

  const latency = (name, qs) => {
    const now = buckets(metrics, name);
    const [win, recent] = windowed(now, previous ? buckets(previous.metrics, name) : null);
    const shown = qs.map((q) => seconds(quantile(win, q))).join(" / ");
    return recent || !win.length ? shown : `${shown} (since start)`;
  };
  document.getElementById("ttft").textContent = latency("heterogate_ttft_seconds", [0.5, 0.9, 0.99]);
  document.getElementById("itl").textContent = latency("heterogate_itl_seconds", [0.5, 0.99]);
  document.getElementById("e2e").textContent = latency("heterogate_e2e_seconds", [0.5, 0.99]);
  const waiting = sum(metrics, "heterogate_admission_queue_waiting").get("") || 0;
  document.getElementById("waiting").textContent = String(waiting);
  const open = sum(metrics, "heterogate_routing_failing_open").get("") || 0;
  document.getElementById("failing-open").textContent = open ? "yes" : "no";

  renderBackends(backends, metrics, rates);
  const outcomes = sum(metrics, "heterogate_requests_total", (l) => l.status);
  renderTable("#outcomes", [...outcomes.entries()].sort().map(([status, n]) => [status, String(n)]));
  const gpuOf = new Map(backends.map((b) => [b.id, b.gpu]));
  const decisions = sum(metrics, "heterogate_routing_decisions_total", (l) => `${l.policy}\t${gpuOf.get(l.backend) || l.backend}`);
  const byPolicy = new Map();
  for (const [key, n] of decisions) {
    const policy = key.split("\t")[0];
    byPolicy.set(policy, (byPolicy.get(policy) || 0) + n);
  }
  renderTable("#decisions", [...decisions.entries()].sort().map(([key, n]) => {
    const [policy, gpu] = key.split("\t");
    return [policy, gpu, String(n), `${(100 * n / (byPolicy.get(policy) || 1)).toFixed(0)}%`];
  }));
}

let keyRefused = false;   // the key last given was not one of this gateway's

function headers() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? {authorization: `Bearer ${key}`} : {};
}

function setStatus(text, error) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(error));
}

async function poll() {
  try {
    const [b, m] = await Promise.all([
      fetch("/admin/backends", {headers: headers(), cache: "no-store"}),
      fetch("/metrics", {headers: headers(), cache: "no-store"}),
    ]);
    const refused = [b.status, m.status].find((s) => s === 401 || s === 403);
    if (refused) {
      // 401: no key, or one this gateway does not know (forgotten, so the form asks again); 403: a user's key
      const given = Boolean(sessionStorage.getItem(KEY_ITEM));
      if (refused === 401 && given) {
        sessionStorage.removeItem(KEY_ITEM);
        keyRefused = true;   // said until another key is given: the next polls go without one
      }
      document.getElementById("key-form").hidden = false;
      setStatus(refused === 403 ? "that key is a user's key: an admin key is needed"
        : keyRefused ? "that key was refused: not a key of this gateway"
        : "an admin key is needed", true);
      return;
    }
    if (!b.ok || !m.ok) throw new Error(`HTTP ${b.ok ? m.status : b.status}`);
    const backends = (await b.json()).data;
    const metrics = withDeparted(parseMetrics(await m.text()));
    const t = Date.now();
    render(backends, metrics, t);
    previous = {t, metrics};
    setStatus(`updated ${new Date(t).toLocaleTimeString()}`);
  } catch (err) {
    setStatus(`gateway unreachable (${err.message})`, true);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, document.getElementById("key").value);
  keyRefused = false;
  document.getElementById("key-form").hidden = true;
});

poll();
