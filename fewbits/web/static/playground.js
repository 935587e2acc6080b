// Quantiser playground: POST /api/try and /api/layer-error; the page only draws and prints their values.
"use strict";

let FAMILIES = {};
let valuesChart = null;
let errorsChart = null;
let seq = 0;
function $(id) { return document.getElementById(id); }

function pct(x) { return x == null ? "–" : `${(100 * x).toFixed(2)}%`; }

function request() {
  const body = {family: $("family").value, bits: Number($("bits").value), group: Number($("group").value),
                asym: $("asym").checked, full_grid: $("fullgrid").checked, outlier: $("outlier").checked,
                seed: Number($("seed").value)};
  const text = $("pasted").value.trim();
  if (text) body.weights = text.split(/[\s,;]+/).filter(Boolean).map(Number);
  return body;
}

function applicable() {
  const f = FAMILIES[$("family").value] || {};
  $("bits").disabled = !f.bits; $("group").disabled = !f.group; $("asym").disabled = !f.asym;
  if (!f.asym) $("asym").checked = false;
  $("fullgrid").disabled = !f.asym || $("asym").checked;  // symmetric integers only
  if ($("fullgrid").disabled) $("fullgrid").checked = false;
}

async function update() {
  applicable();
  setText("bits-out", $("bits").value);
  const my = ++seq;
  let r;
  try { r = await api("/api/try", request()); } catch (e) {
    if (my === seq) { showError(e.message); document.body.dataset.ready = "error"; }
    return;
  }
  if (my !== seq) return;
  showError("");
  setText("out-spec", r.spec);
  setText("out-scales", `${r.scales.length} scale(s) of ${r.weights_per_scale} weights`);
  setText("out-rel", pct(r.rel_error));
  setText("out-max", `max error ${r.max_error.toFixed(5)}`);
  setText("out-zeros", String(r.zeros));
  setText("out-bpw", r.bits_per_weight.toFixed(3));
  setText("out-bytes", `${r.stored_bytes} bytes stored vs ${r.bf16_bytes} in bf16`);
  const tbody = $("values-table").querySelector("tbody"); tbody.innerHTML = "";
  r.original.forEach((w, i) => {
    const tr = document.createElement("tr");
    for (const c of [i, w.toFixed(5), r.codes[i], r.stored[i].toFixed(5), r.errors[i].toFixed(5)]) {
      const td = document.createElement("td"); td.textContent = c; tr.appendChild(td);
    }
    tbody.appendChild(tr);
  });
  draw(r);
  document.body.dataset.ready = String(my);
}

function draw(r) {
  const idx = r.original.map((_, i) => i);
  const zero = new Set(r.zero_index);
  const vdata = {labels: idx, datasets: [
    {label: "original", data: r.original, backgroundColor: "#b9c0c9"},
    {label: "stored", data: r.stored, backgroundColor: idx.map(i => zero.has(i) ? "#c0392b" : "#3b6fd4")}]};
  const edata = {labels: idx, datasets: [{label: "error", data: r.errors, backgroundColor: "#e8a33d"}]};
  const opts = {animation: false, responsive: true, maintainAspectRatio: false, plugins: {legend: {display: false}},
                scales: {x: {ticks: {maxTicksLimit: 16}}}};
  if (valuesChart) { valuesChart.data = vdata; valuesChart.update("none"); } else { valuesChart = new Chart($("values"), {type: "bar", data: vdata, options: opts}); }
  if (errorsChart) { errorsChart.data = edata; errorsChart.update("none"); } else { errorsChart = new Chart($("errors"), {type: "bar", data: edata, options: opts}); }
}

async function runLayer() {
  const body = {weights: $("layer-weights").value.split(",").map(s => s.trim()).filter(Boolean),
                outlier_value: Number($("layer-outlier").value), threshold: Number($("layer-threshold").value)};
  const box = $("layer-error");
  let r;
  try { r = await api("/api/layer-error", body); } catch (e) {
    box.textContent = e.message; box.classList.add("shown"); document.body.dataset.layer = "error"; return;
  }
  box.textContent = ""; box.classList.remove("shown");
  const tbody = $("layer-table").querySelector("tbody"); tbody.innerHTML = "";
  const head = t => { const tr = document.createElement("tr"); const th = document.createElement("th"); th.colSpan = 3; th.textContent = t; tr.appendChild(th); tbody.appendChild(tr); };
  const row = (name, bpw, err) => {
    const tr = document.createElement("tr"); tr.className = "layer-row";
    for (const c of [name, bpw, err]) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    tbody.appendChild(tr);
  };
  head("weight-only (activations stay 16-bit)");
  for (const x of r["weight-only"]) row(`${x.name}: ${x.weights_per_scale} weights per scale`, x.bits_per_weight.toFixed(3), pct(x.rel_error));
  head("weights and activations in 8-bit (one scale per token)");
  for (const x of r.w8a8) row(x.name, x.bits_per_weight.toFixed(3), pct(x.rel_error));
  document.body.dataset.layer = "done";
}

async function init() {
  let opts;
  try { opts = await api("/api/options"); } catch (e) { showError(e.message); return; }
  FAMILIES = opts.families;
  fillSelect($("family"), Object.keys(FAMILIES));
  const later = debounce(update, 150);
  for (const id of ["family", "bits", "group", "asym", "fullgrid", "outlier", "seed", "pasted"]) {
    $(id).addEventListener("change", update);
    if (id === "bits" || id === "seed" || id === "pasted") $(id).addEventListener("input", later);
  }
  $("layer-run").addEventListener("click", runLayer);
  update();
  runLayer();
}

init();
