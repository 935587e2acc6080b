"""Runners for the weight-and-activation methods: SmoothQuant W8A8 and LLM.int8().

SmoothQuant: one statistics pass per block (per-channel activation abs-max of every linear input),
smoothing scales folded through the declared mappings, then int8 per-channel weights (round-to-nearest)
wrapped so that activations are rounded to int8 per token in the forward pass.  With option
``smooth = false`` (`SmoothQuant(smooth=False)`) the same W8A8 runs without smoothing (the baseline it must beat).

LLM.int8(): no calibration; every linear becomes an `Int8OutlierLinear`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import closing
from typing import Any

import torch
from torch import nn

from fewbits.calib.pipeline import (
    Commit,
    _check,
    _split_by_block,
    commit_outside,
    plan_config,
    planned_blocks,
    smooth_modules,
)
from fewbits.calib.runner import check_calibration_data
from fewbits.methods.awq import fold_scales
from fewbits.methods.config import LLMInt8, SmoothQuant
from fewbits.methods.llm_int8 import Int8OutlierLinear
from fewbits.methods.rtn import rtn_quantize
from fewbits.methods.smoothquant import ActQuantLinear, smooth_scales

log = logging.getLogger("fewbits.calib")


def _w8a8_module(w: torch.Tensor, bias: torch.Tensor | None, fmt: str, act_bits: int) -> nn.Module:
    from fewbits.models.qlinear import QuantLinear

    qt = rtn_quantize(w, fmt).to_tensor(tuple(w.shape))
    return ActQuantLinear(QuantLinear(qt, bias), act_bits)


def run_smoothquant(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
                    progress: bool = True) -> dict[str, Any]:
    """SmoothQuant (each mapping with the alpha of its first planned consumer, `SmoothQuant` config) then
    simulated W8A8 (activation bits per layer)."""
    _check(layers, "smoothquant")
    data = check_calibration_data(data, "smoothquant")
    _, arch, by_block, outside = _split_by_block(model, layers)
    first = plan_config(layers[0], SmoothQuant) if layers else SmoothQuant()
    info: dict[str, Any] = {"alpha": first.alpha, "smoothed": []}
    with closing(planned_blocks(model, data, by_block, progress, "smoothquant")) as blocks:  # undone on error
        for run, planned in blocks:
            cfg = {p: plan_config(plan, SmoothQuant) for p, plan in planned.items()}
            if any(c.smooth for c in cfg.values()):
                stats = run.collect({p: run.module(p) for p in planned}, want_hessian=False, stop_early=False)
                for m in arch.smooth:
                    cons = [p for p in m.linears if p in planned]
                    if not cons or not cfg[cons[0]].smooth or any(not stats[p].reached for p in cons):
                        continue
                    found = smooth_modules(run, m)
                    if found is None:
                        continue
                    prev, consumers = found
                    s = smooth_scales(stats[cons[0]].absmax, [c.weight for c in consumers], cfg[cons[0]].alpha,
                                      f"{run.prefix}.{m.prev}")
                    fold_scales(prev.weight.data, getattr(prev, "bias", None), [c.weight.data for c in consumers], s,
                                m.prev_kind, arch.norm_plus_one)
                    info["smoothed"].append(f"{run.prefix}.{m.prev}")
            for p, plan in planned.items():
                mod = run.module(p)
                commit(plan.name, _w8a8_module(mod.weight.detach(), getattr(mod, "bias", None), plan.format,
                                               cfg[p].act_bits))
    commit_outside(model, outside, commit, info)
    return info


def run_llm_int8(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
                 progress: bool = True) -> dict[str, Any]:
    """LLM.int8(): int8 vector-wise weights, outlier activation dimensions (|x| >= threshold) in 16-bit."""
    _check(layers, "llm-int8")
    for plan in layers:
        mod = model.get_submodule(plan.name)
        thr = plan_config(plan, LLMInt8).threshold
        commit(plan.name, Int8OutlierLinear(mod.weight.detach(), getattr(mod, "bias", None), thr))
    return {"threshold": plan_config(layers[0], LLMInt8).threshold if layers else LLMInt8().threshold}
