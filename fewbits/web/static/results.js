// Results: the report files the server was started with (GET /api/results), drawn as they are.
"use strict";

const charts = [null, null];
function $(id) { return document.getElementById(id); }

function chart(i, caption, config) {
  setText(`chart${i + 1}-caption`, caption);
  if (charts[i]) charts[i].destroy();
  charts[i] = config ? new Chart($(`chart${i + 1}`), config) : null;
}

function scatter(datasets, xTitle, yTitle, yLog) {
  return {type: "scatter", data: {datasets}, options: {animation: false, responsive: true, maintainAspectRatio: false,
    scales: {x: {title: {display: true, text: xTitle}}, y: {type: yLog ? "logarithmic" : "linear", title: {display: true, text: yTitle}}},
    plugins: {tooltip: {callbacks: {label: c => c.raw.label || ""}}}}};
}

function quality(r) {
  const bySeries = {};
  for (const row of r.quality) {
    const add = (name, kl, top1) => {
      (bySeries[name] = bySeries[name] || []).push({x: row.bits_per_weight, y: kl, top1, label: `${row.method} ${row.format}`});
    };
    add("all text", row.kl_mean, row.top1);
    for (const [c, v] of Object.entries(row.categories)) add(c, v.kl_mean, v.top1);
  }
  const names = Object.keys(bySeries);
  const kl = names.map((n, i) => ({label: n, data: bySeries[n].filter(p => p.y != null && p.y > 0).sort((a, b) => a.x - b.x),
    showLine: true, borderColor: COLORS[i % COLORS.length], backgroundColor: COLORS[i % COLORS.length]}));
  const top = names.map((n, i) => ({label: n, data: bySeries[n].filter(p => p.top1 != null).map(p => ({x: p.x, y: 100 * p.top1, label: p.label})).sort((a, b) => a.x - b.x),
    showLine: true, borderColor: COLORS[i % COLORS.length], backgroundColor: COLORS[i % COLORS.length]}));
  chart(0, "Mean KL(ref ‖ quant) against bits per weight, per kind of text", scatter(kl, "bits per weight", "KL (nats/token)", true));
  chart(1, "Top-1 agreement (%) against bits per weight, per kind of text", scatter(top, "bits per weight", "top-1 %", false));
  setText("table", r.table);
}

function bench(r) {
  const pts = r.steps.filter(s => s.measured_ms != null && s.predicted_ms != null);
  const max = Math.max(...pts.map(s => Math.max(s.measured_ms, s.predicted_ms)), 1);
  const groups = {};
  for (const s of pts) (groups[s.weights] = groups[s.weights] || []).push({x: s.measured_ms, y: s.predicted_ms,
    label: `W ${s.weights} KV ${s.kv} batch ${s.batch} prompt ${s.prompt}`});
  const ds = Object.entries(groups).map(([w, d], i) => ({label: `W ${w}`, data: d, backgroundColor: COLORS[i % COLORS.length]}));
  ds.push({label: "predicted = measured", data: [{x: 0, y: 0}, {x: max, y: max}], showLine: true, pointRadius: 0, borderColor: "#8a8f98", borderDash: [4, 4]});
  chart(0, `Predicted against measured step time (ms): ${r.model} on ${r.device}`, scatter(ds, "measured ms", "predicted ms", false));
  chart(1, "", null);
  const head = "weights      kv           batch  prompt  measured ms  predicted ms  error %  bound";
  setText("table", [head, ...r.steps.map(s => `${String(s.weights).padEnd(12)} ${String(s.kv).padEnd(12)} ${String(s.batch).padStart(5)} ${String(s.prompt).padStart(7)} ${String(s.measured_ms).slice(0, 11).padStart(12)} ${String(s.predicted_ms).slice(0, 12).padStart(13)} ${String(s.error_pct).slice(0, 7).padStart(8)}  ${s.bound}`)].join("\n"));
}

async function show(id) {
  let r;
  try { r = await api(`/api/results/${id}`); } catch (e) { showError(e.message); document.body.dataset.ready = "error"; return; }
  showError("");
  setText("table-title", `${r.path} (${r.kind})`);
  if (r.kind === "bench") bench(r);
  else if (r.kind === "quantize") { chart(0, "", null); chart(1, "", null); setText("table", JSON.stringify(r.meta, null, 1)); }
  else quality(r);
  document.body.dataset.ready = String(id);
}

async function init() {
  let list;
  try { list = await api("/api/results"); } catch (e) { showError(e.message); return; }
  if (!list.root) { setText("root", list.hint); document.body.dataset.ready = "empty"; return; }
  setText("root", `Reports under ${list.root}/ (the folder given with --results).`);
  const sel = $("report"); sel.innerHTML = "";
  for (const r of list.reports) { const o = document.createElement("option"); o.value = r.id; o.textContent = `${r.path} (${r.kind})`; sel.appendChild(o); }
  sel.addEventListener("change", () => show(sel.value));
  const q = new URLSearchParams(location.search);
  if (q.has("report")) sel.value = q.get("report");
  if (list.reports.length) show(sel.value); else document.body.dataset.ready = "empty";
}

init();
