"""The fit of `fewbits probe`'s skeleton steps (`fewbits.bench.probe.step_costs`) into the profile's per-step figures:
fixed cost per step and per layer, cost per extra sequence, KV read rates per format, a windowed cache's extra
costs, with the measured core-cache refill taken off (`fit_step_costs`); and those figures as `Profile` fields
(`step_profile_fields`).  Pure arithmetic on measured times, apart from the measuring in probe.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fewbits.cost.profile import DEFAULT, format_family
from fewbits.cost.step import attention_layer_bytes, kv_step_bytes, kv_terms
from fewbits.kvcache.format import parse_kv_format
from fewbits.models.spec import ModelSpec


def _clamp(x: float) -> float:
    return float(min(1.0, max(1e-3, x)))


#: fitted columns that may be negative where the skeleton ran at one depth: a quantised cache's fixed cost per layer
#: relative to the 16-bit cache's (its operator may do less per layer); every other column is a time or a time per
#: byte (>= 0).  At several depths that column is the cache's own fixed cost per layer, >= 0 too.
SIGNED = ("x:",)


def bounded_lstsq(x: np.ndarray, y: np.ndarray, cols: list[str], signed: tuple[str, ...] = SIGNED
                  ) -> dict[str, float]:
    """Least squares of y over the columns of x, every column but those whose names start with one of `signed`
    held >= 0 (`scipy.optimize.lsq_linear`, bounded-variable least squares; the columns scaled to unit norm first).

    An unbounded fit of noisy steps trades one cost against another it is nearly collinear with: on a shared host
    whose steps varied 30% a probe fitted -0.98 ms per extra sequence (a batch-8 step's larger cache read standing
    in for it) and -0.14 ms fixed, figures no step can have; bounded, such a column is 0 and the others carry
    the time.  Exact data inside the bounds give the plain least-squares solution."""
    from scipy.optimize import lsq_linear

    if not cols:
        return {}
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    lo = np.array([-np.inf if signed and n.startswith(signed) else 0.0 for n in cols])
    sol = lsq_linear(x / scale, y, bounds=(lo, np.full(len(cols), np.inf)), method="bvls", tol=1e-12)
    return dict(zip(cols, (sol.x / scale).tolist(), strict=True))


def fit_step_costs(spec: ModelSpec, kv_specs: tuple[str, ...], fastest: dict[tuple[int | str, ...], float],
                   steps: int, x_cache: int, refill_s: float | None = None,
                   refill_curve: list[tuple[float, float]] | None = None,
                   measured: dict[tuple[int | str, ...], float] | None = None) -> dict[str, dict[str, Any]]:
    """The joint least-squares fit (`bounded_lstsq`) of `step_costs` over measured step times
    {(kv, batch, prompt[, depth]): seconds} (no depth: the model's own).  `measured`: the steps as timed, before
    anything was taken off them (the same keys): each point then weighs 1 / its timed step, as a shared host's
    noise is a share of what it times.  Unweighted, the longest steps decide the fit: with 2048-token points
    (3-4 ms at batch 8) a probe fitted the 16-bit cache's fixed cost at 0.003 ms, the next at 0.080; weighted,
    0.146 and 0.155 from the same two probes' points.  `refill_s` (E, measured) is taken as
    given, None fits it; with `refill_curve` (measured E(x), seconds per layer) the fit subtracts L E(x) instead
    of L E min(1, x / X).  A column the measurements cannot tell apart (no quantised bytes, a window that never
    overflows or always has, a single depth) is left out: its cost is 0.  The figures are for `spec.n_layers` layers."""
    import dataclasses

    pts = {(k[0], k[1], k[2], k[3] if len(k) > 3 else spec.n_layers): t for k, t in fastest.items()}
    base_kv = "bf16" if "bf16" in kv_specs else kv_specs[0]
    rows: list[dict[str, float]] = []
    ys: list[float] = []
    weights: list[float] = []
    stream: list[tuple[float, int]] = []  # (x, L) of each row: a layer's 16-bit keys and values, the depth
    batch_of: list[int] = []  # each row's batch
    points: dict[str, list[tuple[int, ...]]] = {s: [] for s in kv_specs}
    if measured is not None:
        measured = {(k[0], k[1], k[2], k[3] if len(k) > 3 else spec.n_layers): t for k, t in measured.items()}
    for key, t in sorted(pts.items(), key=lambda kv: (kv_specs.index(kv[0][0]), *kv[0][1:])):
        s, b, c, depth = key
        kvf = parse_kv_format(s)
        sd = dataclasses.replace(spec, n_layers=depth) if depth != spec.n_layers else spec
        terms = kv_terms(sd, kvf.full_spec, DEFAULT)
        L = float(depth)
        ctx = c + (steps + 1) // 2  # mean context of the timed steps
        kb = {k: float(v) for k, v in kv_step_bytes(terms, b, ctx).items()}
        q, w = kb["read_q"] + kb["write_q"], kb["read_w"] + kb["write_w"]
        x = float(attention_layer_bytes(spec, b * (ctx + 1)))
        row = {"a0": 1.0, "a1": L, "p0": b - 1.0, "p1": (b - 1.0) * L,
               "E": L * min(1.0, x / x_cache) if x_cache > 0 else 0.0}
        if s != base_kv:
            row[f"x:{s}"] = L
        if not kvf.is_quantized:  # a 16-bit cache: all of it streams at the 16-bit rate
            row["s16"] = (q + w) * 1e-9  # bytes in GB: a well-conditioned fit
        else:
            row[f"s:{s}"] = q * 1e-9
            row[f"w:{s}"] = w * 1e-9  # the window: copied every step by the store, its own rate
            row[f"o:{s}"] = L * float(kvf.quantized_tokens(c + steps) > 0)  # dequantises only then
        row["_fmt"] = kv_specs.index(s)
        rows.append(row)
        stream.append((x, depth))
        batch_of.append(int(b))
        ys.append(t)
        weights.append(1.0 / measured[key] if measured is not None else 1.0)
        points[s].append((b, c, q + w, t, depth))  # batch, prompt, bytes, seconds, depth
    names = [n for n in dict.fromkeys(k for r in rows for k in r) if n != "_fmt"]
    by_layer = len({d for _, d in stream}) > 1
    if not by_layer:  # one depth: the fixed costs are not split by layer
        names = [n for n in names if n not in ("a1", "p1")]
    else:  # x:s is then another cache's own fixed cost per layer (a1 the 16-bit cache's), a time like a1: >= 0
        for r in rows:
            if kv_specs[int(r["_fmt"])] != base_kv:
                r["a1"] = 0.0
    for n in list(names):  # columns the points cannot identify
        col = [r.get(n, 0.0) for r in rows]
        own = [r.get(n, 0.0) for r in rows if n[:2] == "o:" and kv_specs[int(r["_fmt"])] == n[2:]]
        if not any(col) or (n[:2] == "o:" and all(own)):
            names.remove(n)

    if refill_curve:  # the measured E(x) per row, all layers
        cx, cy = [0.0] + [p[0] for p in refill_curve], [0.0] + [p[1] for p in refill_curve]
        known = [d * float(np.interp(x, cx, cy)) for x, d in stream]
    else:
        known = [r["E"] for r in rows]

    # the cache's time per byte at each batch, x the largest batch's (`Profile.kv_batch_factor`): fitted on the
    # 16-bit cache, its byte column split by batch, where it ran at several batches with several sizes at each
    sizes: dict[int, set[float]] = {}
    for r, b in zip(rows, batch_of, strict=True):
        if "s16" in r:
            sizes.setdefault(b, set()).add(r["s16"])
    per_batch = len(sizes) > 1 and all(len(v) > 1 for v in sizes.values())
    factor = dict.fromkeys(sizes, 1.0)

    def fit(cols: list[str], known_e: float = 0.0, split: bool = False) -> dict[str, float]:
        """`split`: the 16-bit byte column one per batch ("s16@b"); else every byte column x its batch's factor."""
        wt = np.array(weights, dtype=np.float64)

        def value(r: dict[str, float], n: str, b: int) -> float:
            if split and n.startswith("s16@"):
                return r.get("s16", 0.0) if int(n[4:]) == b else 0.0
            v = r.get(n, 0.0)
            return v * factor.get(b, 1.0) if n == "s16" or n[:2] in ("s:", "w:") else v

        x = np.array([[value(r, n, b) for n in cols] for r, b in zip(rows, batch_of, strict=True)],
                     dtype=np.float64) * wt[:, None]
        y = np.array([t - known_e * k for t, k in zip(ys, known, strict=True)], dtype=np.float64) * wt
        return bounded_lstsq(x, y, cols, signed=() if by_layer else SIGNED)

    def split_cols(cols: list[str]) -> list[str]:
        return [c for n in cols for c in ([f"s16@{b}" for b in sorted(sizes)] if n == "s16" else [n])]

    no_e = [n for n in names if n != "E"]
    refill: float | None
    if refill_curve:
        refill, cols, known_e = (refill_s if refill_s is not None else 0.0), no_e, 1.0
    elif refill_s is not None or "E" not in names:
        refill = refill_s if "E" in names and refill_s is not None else 0.0
        cols, known_e = no_e, refill
    else:  # (E >= 0: a refill the points do not show is 0, as if fitted without it)
        refill, cols, known_e = None, names, 0.0
    if per_batch:  # first the 16-bit cache's rate per batch, then every cache's rate at the largest batch
        first = fit(split_cols(cols), known_e, split=True)
        top = first[f"s16@{max(sizes)}"]
        if top > 0:
            factor = {b: first[f"s16@{b}"] / top if first[f"s16@{b}"] > 0 else 1.0 for b in sizes}
    sol = fit(cols, known_e)
    if refill is None:
        refill = sol.get("E", 0.0)
    out: dict[str, dict[str, Any]] = {}
    s16 = sol.get("s16", 0.0) * 1e-9
    n = float(spec.n_layers)
    for s in kv_specs:
        xs = sol.get(f"x:{s}", 0.0)  # at several depths this cache's own cost per layer, else relative to a1's
        per_layer = xs if by_layer and f"x:{s}" in sol else sol.get("a1", 0.0) + xs
        out[s] = {"fixed_s": sol["a0"] + n * per_layer,
                  "per_seq_s": sol.get("p0", 0.0) + n * sol.get("p1", 0.0),
                  "s_per_byte": sol[f"s:{s}"] * 1e-9 if f"s:{s}" in sol else s16,
                  "window_s_per_byte": sol[f"w:{s}"] * 1e-9 if f"w:{s}" in sol else s16,
                  "quantized_s": n * sol.get(f"o:{s}", 0.0), "refill_s": refill, "refill_bytes": x_cache,
                  "refill_curve": [list(p) for p in refill_curve or []],
                  "batch_factor": [[b, factor[b]] for b in sorted(factor)] if per_batch else [],
                  "points": points[s]}
    return out


def step_profile_fields(spec: ModelSpec, kv: dict[str, dict[str, Any]], bw: float, log: Any = print,
                        bw_at: Any = None, weight_bytes: float = 0.0) -> dict[str, Any]:
    """The `Profile` fields that the skeleton sweep (`step_costs`) measures, from its fit and the bandwidth.

    `bw_at(bytes)`: the bandwidth at a working set (the probe's `bandwidth_curve`).  A cache's efficiency is
    relative to it at the working set of a step of the model itself at the skeleton's largest cache: that cache
    at the model's depth plus `weight_bytes` (the fewest bytes a step of the model reads beside its cache, the
    GEMV passes' smallest and the LM head), as the step model reads the cache at the bandwidth of the whole
    step's working set.  (A cache read at memory speed costs more per byte than from the last-level cache:
    SmolLM2 at batch 8 and 512 tokens paid ~96 ms per GB of cache beside its weights, a skeleton stepped alone
    ~42.)  Without `bw_at` it is relative to `bw`: what the probe passes where its skeleton's cache was evicted
    before each step (`fewbits.bench.evict`), so read from memory."""
    base = kv["bf16"] if "bf16" in kv else next(iter(kv.values()))
    overhead, per_seq = max(base["fixed_s"], 0.0), max(base["per_seq_s"], 0.0)
    kv_eff: dict[str, float] = {}
    kv_extra: dict[str, float] = {}
    kv_window: dict[str, float] = {}
    kv_dequant: dict[str, float] = {}
    for s, r in kv.items():
        kvf = parse_kv_format(s)
        fam = format_family(kvf.cost_format(spec.head_dim))
        largest = max((float(pt[2]) * spec.n_layers / pt[4] for pt in r.get("points", [])), default=0.0)
        beta = bw_at(largest + weight_bytes) if bw_at is not None and largest > 0 else bw
        kv_eff.setdefault(fam, _clamp(1.0 / (r["s_per_byte"] * beta)) if r["s_per_byte"] > 0 else 1.0)
        extra = ""
        if r is not base:
            kv_extra.setdefault(fam, (r["fixed_s"] - base["fixed_s"]) / spec.n_layers)
        if kvf.residual > 0:
            w = r.get("window_s_per_byte", 0.0)
            kv_window.setdefault(fam, _clamp(1.0 / (w * beta)) if w > 0 else 1.0)
            kv_dequant.setdefault(fam, r.get("quantized_s", 0.0) / spec.n_layers)
            extra = (f"; window {w * 1e12:.3f} ms per GB, {r.get('quantized_s', 0.0) * 1e3:+.2f} ms once it "
                     "holds quantised tokens")
        log(f"  {s:>9}: {r['fixed_s'] * 1e3:6.2f} ms fixed, {r['per_seq_s'] * 1e3:+.2f} ms per extra sequence, "
            f"{r['s_per_byte'] * 1e12:.3f} ms per GB of cache (eta {kv_eff[fam]:.3f}){extra}")
    kv_eff.setdefault("float", 1.0)
    batch_factor = tuple((float(b), float(f)) for b, f in base.get("batch_factor", []))
    if batch_factor:
        log("  the cache's time per byte by batch (x the largest's, which the rates above are): " + ", ".join(
            f"batch {b:.0f} {f:.2f}x" for b, f in batch_factor))
    refill, refill_bytes = max(base.get("refill_s", 0.0), 0.0), float(base.get("refill_bytes", 0))
    curve = tuple((float(b), float(e)) for b, e in base.get("refill_curve", []))
    if curve:
        log("  refill per layer by the bytes it streams: " + ", ".join(
            f"{b / 2**20:.1f} MiB {e * 1e6:.0f} us" for b, e in curve))
    if refill > 0:
        log(f"  a layer streaming >= {refill_bytes / 2**20:.1f} MiB (the L2 cache) costs the step's small "
            f"operations {refill * 1e6:.1f} us to refill (x {spec.n_layers} layers)")
    return {"overhead_s": overhead, "overhead_per_seq_s": per_seq, "kv_bandwidth_efficiency": kv_eff,
            "kv_layer_overhead_s": kv_extra, "kv_quantized_overhead_s": kv_dequant,
            "kv_window_bandwidth_efficiency": kv_window, "kv_batch_factor": batch_factor, "cache_refill_s": refill,
            "cache_refill_bytes": refill_bytes if refill > 0 else 0.0, "cache_refill_curve": curve}
