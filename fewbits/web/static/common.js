// fewbits ui: what every page shares.  No number is computed here: the API sends them all.
"use strict";

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const res = await fetch(path, opts);
  let data = null;
  try { data = await res.json(); } catch (e) { data = null; }
  if (!res.ok) {
    const msg = data && typeof data.detail === "string" ? data.detail : `${res.status} ${res.statusText}`;
    throw new Error(msg);
  }
  return data;
}

function showError(msg) {
  const el = document.getElementById("error");
  el.textContent = msg || "";
  el.classList.toggle("shown", Boolean(msg));
}

function setText(id, text) {
  const el = document.getElementById(id);
  if (el) el.textContent = text;
}

function fillSelect(sel, values, labels) {
  sel.innerHTML = "";
  for (const v of values) {
    const o = document.createElement("option");
    o.value = v;
    o.textContent = labels && labels[v] ? `${v}: ${labels[v]}` : v;
    sel.appendChild(o);
  }
}

function debounce(fn, ms) {
  let t = null;
  return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); };
}

const COLORS = ["#3b6fd4", "#e8a33d", "#2e9e6b", "#b0479a", "#5b6470", "#c0392b", "#17a2b8", "#7c5cbf", "#8a6d3b"];
