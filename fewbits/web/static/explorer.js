// Decode explorer: the state lives in the URL; every number shown is a string or value from POST /api/plan.
"use strict";

const FIELDS = ["model", "device", "weights", "kv", "batch", "context", "devices", "profile"];
const INTS = new Set(["batch", "context", "devices"]);
let DEFAULTS = null;
let uploaded = null;  // {name, config} of a dropped config.json (kept out of the URL: it is a file)
let barChart = null;
let sweepChart = null;
let seq = 0;

function $(id) { return document.getElementById(id); }

function readState() {
  const s = {};
  for (const f of FIELDS) s[f] = INTS.has(f) ? Number($(f).value) : $(f).value;
  s.table_weights = $("table-weights").value.split(",").map(x => x.trim()).filter(Boolean);
  s.table_kv = $("table-kv").value.split(",").map(x => x.trim()).filter(Boolean);
  s.sweep_axis = $("sweep-axis").value;
  return s;
}

function writeState(s) {
  for (const f of FIELDS) {
    const el = $(f);
    if (el.tagName === "SELECT" && ![...el.options].some(o => o.value === String(s[f]))) {
      const o = document.createElement("option"); o.value = s[f]; o.textContent = s[f]; el.appendChild(o);
    }
    el.value = s[f];
  }
  $("table-weights").value = s.table_weights.join(",");
  $("table-kv").value = s.table_kv.join(",");
  $("sweep-axis").value = s.sweep_axis;
  syncSliders();
}

function syncSliders() {
  $("batch-slider").value = Math.round(Math.log2(Math.max(1, Number($("batch").value) || 1)));
  $("context-slider").value = Math.round(Math.log2(Math.max(1, Number($("context").value) || 1)));
}

function stateFromURL() {
  const q = new URLSearchParams(location.search);
  const s = structuredClone(DEFAULTS);
  for (const f of FIELDS) if (q.has(f)) s[f] = INTS.has(f) ? Number(q.get(f)) : q.get(f);
  if (q.has("tw")) s.table_weights = q.get("tw").split(",").filter(Boolean);
  if (q.has("tk")) s.table_kv = q.get("tk").split(",").filter(Boolean);
  if (q.has("axis")) s.sweep_axis = q.get("axis");
  return s;
}

function stateToURL(s) {
  const q = new URLSearchParams();
  for (const f of FIELDS) if (String(s[f]) !== String(DEFAULTS[f])) q.set(f, s[f]);
  if (s.table_weights.join(",") !== DEFAULTS.table_weights.join(",")) q.set("tw", s.table_weights.join(","));
  if (s.table_kv.join(",") !== DEFAULTS.table_kv.join(",")) q.set("tk", s.table_kv.join(","));
  if (s.sweep_axis !== DEFAULTS.sweep_axis) q.set("axis", s.sweep_axis);
  const qs = q.toString();
  history.replaceState(null, "", qs ? `?${qs}` : location.pathname);
}

async function update() {
  const s = readState();
  const body = {...s};
  if (uploaded && s.model === `file:${uploaded.name}`) {
    body.model = "llama-3-8b"; body.config = uploaded.config; body.config_name = uploaded.name;
  } else {
    stateToURL(s);
  }
  const my = ++seq;
  let d;
  try {
    d = await api("/api/plan", body);
  } catch (e) {
    if (my === seq) { showError(e.message); document.body.dataset.ready = "error"; }
    return;
  }
  if (my !== seq) return;
  showError("");
  render(d);
  document.body.dataset.ready = String(my);
}

function render(d) {
  const v = d.view;
  setText("title", v.title);
  setText("out-weight-bytes", v.weight_bytes); setText("out-weight-was", v.weight_bytes_bf16);
  setText("out-kv-bytes", v.kv_bytes); setText("out-kv-was", v.kv_bytes_bf16);
  setText("out-time", v.time); setText("out-time-note", v.time_note);
  setText("out-tps", v.tokens_per_s); setText("out-speedup", v.speedup);
  setText("out-memory", `Memory: ${v.memory}`);
  $("out-memory").classList.toggle("nofit", !v.fits);
  setText("command", d.command);
  const notes = $("notes"); notes.innerHTML = "";
  for (const n of v.notes) { const li = document.createElement("li"); li.textContent = n; notes.appendChild(li); }
  const list = $("bar-list"); list.innerHTML = "";
  for (const b of d.bars) {
    const li = document.createElement("li"); li.className = "bar";
    li.textContent = `${b.label}: ${b.text}${b.fits ? "" : " (does not fit)"}`; list.appendChild(li);
  }
  drawBars(d.bars);
  drawSweep(d.sweep);
}

function drawBars(bars) {
  $("bars").parentElement.style.height = `${Math.max(240, 34 * bars.length + 60)}px`;
  const data = {
    labels: bars.map(b => `${b.label}  ${b.text}${b.fits ? "" : " ✗"}`),
    datasets: [
      {label: "weights", data: bars.map(b => b.weights_ms), backgroundColor: "#3b6fd4"},
      {label: "cache", data: bars.map(b => b.cache_ms), backgroundColor: "#e8a33d"},
      {label: "overhead", data: bars.map(b => b.overhead_ms), backgroundColor: "#8a8f98"}]};
  if (barChart) { barChart.data = data; barChart.update("none"); return; }
  barChart = new Chart($("bars"), {type: "bar", data, options: {
    indexAxis: "y", animation: false, responsive: true, maintainAspectRatio: false,
    scales: {x: {stacked: true, title: {display: true, text: "ms per step"}}, y: {stacked: true}},
    plugins: {legend: {display: false}}}});
}

const crossoverLine = {
  id: "crossover",
  afterDatasetsDraw(chart, args, opts) {
    if (opts.x == null) return;
    const x = chart.scales.x.getPixelForValue(opts.x);
    if (x < chart.chartArea.left || x > chart.chartArea.right) return;
    const ctx = chart.ctx; ctx.save(); ctx.strokeStyle = "#c0392b"; ctx.setLineDash([5, 4]);
    ctx.beginPath(); ctx.moveTo(x, chart.chartArea.top); ctx.lineTo(x, chart.chartArea.bottom); ctx.stroke();
    ctx.fillStyle = "#c0392b"; ctx.fillText("cache > weights", x + 4, chart.chartArea.top + 12); ctx.restore();
  }};

function drawSweep(sw) {
  setText("sweep-caption", `Tokens/s against ${sw.axis === "batch" ? "batch" : "context per sequence"} (× marks: does not fit)`);
  setText("crossover", sw.crossover_text);
  const datasets = sw.lines.map((l, i) => ({
    label: l.label, data: sw.x.map((x, j) => ({x, y: l.tokens_per_s[j]})), borderColor: COLORS[i % COLORS.length],
    backgroundColor: COLORS[i % COLORS.length], pointStyle: l.fits.map(f => f ? "circle" : "crossRot"),
    pointRadius: 3}));
  if (sweepChart) sweepChart.destroy();
  sweepChart = new Chart($("sweep"), {type: "line", data: {datasets}, plugins: [crossoverLine], options: {
    animation: false, responsive: true, maintainAspectRatio: false,
    scales: {x: {type: "logarithmic", title: {display: true, text: sw.axis === "batch" ? "batch" : "context per sequence"}},
             y: {type: "logarithmic", title: {display: true, text: "tokens/s"}}},
    plugins: {crossover: {x: sw.crossover}, legend: {labels: {boxWidth: 12}}}}});
}

async function loadConfig(file) {
  if (file.size > 1000000) { showError(`${file.name}: over 1 MB; a config.json is a few kB`); return; }
  let cfg;
  try { cfg = JSON.parse(await file.text()); } catch (e) { showError(`${file.name} is not valid JSON: ${e.message}`); return; }
  uploaded = {name: file.name.replace(/[^A-Za-z0-9._-]/g, "_").slice(0, 60) || "config.json", config: cfg};
  const sel = $("model"); const value = `file:${uploaded.name}`;
  if (![...sel.options].some(o => o.value === value)) {
    const o = document.createElement("option"); o.value = value; o.textContent = `${uploaded.name} (dropped)`; sel.prepend(o);
  }
  sel.value = value;
  update();
}

async function init() {
  let opts;
  try { opts = await api("/api/options"); } catch (e) { showError(e.message); return; }
  DEFAULTS = opts.defaults;
  fillSelect($("model"), opts.models);
  fillSelect($("device"), Object.keys(opts.devices), opts.devices);
  fillSelect($("weights"), opts.weights);
  fillSelect($("kv"), opts.kv);
  fillSelect($("profile"), opts.profiles);
  writeState(stateFromURL());
  const later = debounce(update, 120);
  for (const id of [...FIELDS, "table-weights", "table-kv", "sweep-axis"]) {
    $(id).addEventListener("change", update);
    if ($(id).tagName === "INPUT") $(id).addEventListener("input", later);
  }
  $("batch-slider").addEventListener("input", () => { $("batch").value = 2 ** Number($("batch-slider").value); later(); });
  $("context-slider").addEventListener("input", () => { $("context").value = 2 ** Number($("context-slider").value); later(); });
  $("batch").addEventListener("input", syncSliders); $("context").addEventListener("input", syncSliders);
  $("copy").addEventListener("click", async () => {
    const text = $("command").textContent;
    try { await navigator.clipboard.writeText(text); } catch (e) {
      const r = document.createRange(); r.selectNodeContents($("command"));
      const s = getSelection(); s.removeAllRanges(); s.addRange(r); document.execCommand("copy");
    }
    setText("copied", "copied");
    setTimeout(() => setText("copied", ""), 1500);
  });
  $("config-file").addEventListener("change", e => { if (e.target.files[0]) loadConfig(e.target.files[0]); });
  const drop = $("drop");
  drop.addEventListener("keydown", e => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("config-file").click(); } });
  drop.addEventListener("dragover", e => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", e => { e.preventDefault(); drop.classList.remove("over"); if (e.dataTransfer.files[0]) loadConfig(e.dataTransfer.files[0]); });
  update();
}

init();
