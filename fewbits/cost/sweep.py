"""Vectorised sweeps: every (weight format, KV format, batch, context) at once with numpy.

`sweep()` stacks the per-format terms of `fewbits.cost.step` into arrays of shape (W, 1, 1, 1) and
(1, K, 1, 1) and broadcasts them against batch (1, 1, B, 1) and context (1, 1, 1, C), so the step model
runs once for all W x K x B x C configurations.  `summarize()` answers the two questions of
`fewbits plan --sweep`: where the cache overtakes the weights, and where the step turns compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from fewbits.cost.devices import DeviceSpec, get_device
from fewbits.cost.profile import Profile, load_profile
from fewbits.cost.step import KVTerms, WeightTerms, decode, kv_terms, memory, weight_terms
from fewbits.models.presets import resolve_model
from fewbits.models.spec import ModelSpec


@dataclass
class SweepResult:
    """Arrays of shape (len(weights), len(kv), len(batch), len(context)); byte figures per device."""

    model: str
    device: str
    weights: list[str]
    kv: list[str]
    batch: np.ndarray
    context: np.ndarray
    time: np.ndarray
    tokens_per_s: np.ndarray
    weight_bytes: np.ndarray
    kv_bytes: np.ndarray
    compute_bound: np.ndarray
    fits: np.ndarray

    @property
    def size(self) -> int:
        return int(self.time.size)


def _stack(terms: list[Any], cls: type, axis: int) -> SimpleNamespace:
    shape = [1, 1, 1, 1]
    shape[axis] = len(terms)
    out = {}
    for f in fields(cls):
        vals = [getattr(t, f.name) for t in terms]
        out[f.name] = np.array(vals).reshape(shape) if isinstance(vals[0], float) else vals
    return SimpleNamespace(**out)


def sweep(model: str | Path | ModelSpec, device: str | DeviceSpec = "h100", batch: Any = (1, 8, 32),
          context: Any = (1024, 4096, 16384), weights: Any = ("bf16",), kv: Any = ("bf16",), devices: int = 1,
          profile: str | Path | Profile = "default", activations: str = "auto", misfit: str = "error",
          lm_head: str | None = None) -> SweepResult:
    """Evaluate the decode step for every combination of the given axes in one numpy pass (`misfit`: as
    in `plan`)."""
    prof = load_profile(profile)
    spec = resolve_model(model)
    dev = get_device(device)
    b = np.asarray(batch, dtype=float).reshape(1, 1, -1, 1)
    c = np.asarray(context, dtype=float).reshape(1, 1, 1, -1)
    if (b <= 0).any() or (c <= 0).any():
        raise ValueError("batch and context values must be positive")
    wt = _stack([weight_terms(spec, f, dev, prof, devices, activations, misfit, lm_head) for f in weights],
                WeightTerms, 0)
    kt = _stack([kv_terms(spec, f, prof, devices) for f in kv], KVTerms, 1)
    st = decode(spec, dev, prof, wt, kt, b, c, devices)
    fit = memory(dev, prof, wt, kt, b, c)["fits"]
    shape = np.broadcast_shapes(st["time"].shape, fit.shape)
    return SweepResult(spec.name, dev.name, list(wt.spec), list(kt.spec), b.ravel(), c.ravel(),
                       np.broadcast_to(st["time"], shape), np.broadcast_to(st["tokens_per_s"], shape),
                       np.broadcast_to(st["weight_bytes"], shape), np.broadcast_to(st["kv_bytes"], shape),
                       np.broadcast_to(st["compute_bound"], shape), np.broadcast_to(fit, shape))


def summarize(res: SweepResult, model: str | Path | ModelSpec, device: str | DeviceSpec = "h100",
              devices: int = 1, profile: str | Path | Profile = "default", activations: str = "auto",
              max_batch: int = 4096, misfit: str = "error", lm_head: str | None = None) -> list[str]:
    """Lines saying, per format pair, at which context per sequence the cache read overtakes the weights
    (for each batch) and from which batch the step is compute-bound (for each context)."""
    prof = load_profile(profile)
    spec, dev = resolve_model(model), get_device(device)
    lines = []
    batches = np.arange(1, max_batch + 1, dtype=float).reshape(1, 1, -1, 1)
    for i, wf in enumerate(res.weights):
        w = weight_terms(spec, wf, dev, prof, devices, activations, misfit, lm_head)
        for j, kf in enumerate(res.kv):
            k = kv_terms(spec, kf, prof, devices)
            lines.append(f"weights {wf}, KV {kf}:")
            for bi, b in enumerate(res.batch):
                wb = float(res.weight_bytes[i, j, bi, 0])
                lines.append(f"  batch {b:g}: the cache outweighs the weights beyond {wb / k.per_token / b:,.0f} "
                             "tokens of context per sequence")
            cb = decode(spec, dev, prof, w, k, batches, res.context.reshape(1, 1, 1, -1), devices)["compute_bound"]
            for ci, c in enumerate(res.context):
                hit = np.flatnonzero(np.broadcast_to(cb, (1, 1, max_batch, len(res.context)))[0, 0, :, ci])
                where = f"from batch {int(hit[0]) + 1}" if hit.size else f"never up to batch {max_batch}"
                cap = int(memory(dev, prof, w, k, 1, c)["max_batch"])
                lines.append(f"  context {c:g}: compute-bound {where} (memory holds batch {cap})")
    return lines


def format_sweep_table(res: SweepResult) -> str:
    """One row per configuration: formats, batch, context, step time, tok/s, bound, fits."""
    rows = [f"{'weights':<14}{'KV':<10}{'batch':>7}{'context':>9}{'step ms':>10}{'tok/s':>10}"
            f"{'KV/W':>7}  bound    fits"]
    for i, wf in enumerate(res.weights):
        for j, kf in enumerate(res.kv):
            for bi, b in enumerate(res.batch):
                for ci, c in enumerate(res.context):
                    ix = (i, j, bi, ci)
                    rows.append(f"{wf:<14}{kf:<10}{b:>7g}{c:>9g}{res.time[ix] * 1e3:>10.3f}"
                                f"{res.tokens_per_s[ix]:>10.0f}{res.kv_bytes[ix] / res.weight_bytes[ix]:>7.2f}  "
                                f"{'compute' if res.compute_bound[ix] else 'memory':<8} "
                                f"{'yes' if res.fits[ix] else 'no'}")
    return "\n".join(rows)
