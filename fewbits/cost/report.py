"""The JSON answer of `fewbits plan`: one function that both the command line and `fewbits ui` call.

`plan_report()` runs `plan()`, refuses weights that cannot fit on the devices at all (with the formats that
would), and adds the sweep of `--sweep` when axes are given, so that `fewbits plan --json` and the web API
return the very same dictionary for the same inputs.  Pure Python + numpy; never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fewbits.cost.devices import DeviceSpec
from fewbits.cost.plan import TABLE_KV, TABLE_WEIGHTS, PlanError, PlanResult, pick_device, plan
from fewbits.cost.profile import Profile, load_profile
from fewbits.models.spec import ModelSpec

DEFAULT_SWEEP: dict[str, tuple[int, ...]] = {"batch": (1, 8, 32, 128), "context": (1024, 4096, 16384, 65536)}


@dataclass(frozen=True)
class PlanReport:
    """A plan, its JSON (as `fewbits plan --json` prints it) and the sweep's text lines (empty without one)."""

    result: PlanResult
    data: dict[str, Any]
    sweep_lines: list[str] = field(default_factory=list)


def weights_fit_message(r: PlanResult) -> str | None:
    """Why the weights alone cannot fit on `r.devices` devices (and what would), or None when they can."""
    if r.weights_fit:
        return None
    fitting = list(dict.fromkeys(t.weights for t in r.table if t.fits))
    usable_one = (r.memory_capacity - r.memory_headroom) / r.devices
    need = math.ceil(r.memory_weights / usable_one)
    hint = f"; formats that fit at this batch/context: {', '.join(fitting)}" if fitting else ""
    hint += f"; the weights alone need at least {need} devices"
    return (f"{r.model} in {r.weights} needs {r.memory_weights / 1e9:.1f} GB for its weights alone, but "
            f"{r.devices} x {r.device} hold {r.memory_capacity / 1e9 - r.memory_headroom / 1e9:.1f} GB "
            f"({r.memory_capacity / 1e9:.0f} GB less {r.memory_headroom / 1e9:.1f} GB headroom); try a smaller "
            f"format or more --devices{hint}")


def sweep_report(r: PlanResult, model: str | Path | ModelSpec, device: str | DeviceSpec | None,
                 profile: str | Path | Profile, activations: str, devices: int, axes: dict[str, tuple[int, ...]],
                 misfit: str = "error", lm_head: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """The sweep of `fewbits plan --sweep` for the plan's own formats: its text lines and its JSON."""
    from fewbits.cost.sweep import format_sweep_table, summarize, sweep

    dev = pick_device(device, load_profile(profile))
    res = sweep(model, dev, axes["batch"], axes["context"], (r.weights,), (r.kv,), devices, profile, activations,
                misfit, lm_head)
    lines = summarize(res, model, dev, devices, profile, activations, misfit=misfit, lm_head=lm_head)
    data = {"batch": res.batch.tolist(), "context": res.context.tolist(), "time_s": res.time[0, 0].tolist(),
            "tokens_per_s": res.tokens_per_s[0, 0].tolist(), "compute_bound": res.compute_bound[0, 0].tolist(),
            "fits": res.fits[0, 0].tolist(), "summary": lines}
    return ["", "sweep:", format_sweep_table(res), "", *lines], data


def plan_report(model: str | Path | ModelSpec = "llama-3-8b", device: str | DeviceSpec | None = None,
                batch: int = 1, context: int = 2048, weights: str = "bf16", kv: str = "bf16", devices: int = 1,
                profile: str | Path | Profile = "default", activations: str = "auto",
                table_weights: tuple[str, ...] | None = None, table_kv: tuple[str, ...] | None = None,
                misfit: str = "error", lm_head: str | None = None,
                sweep_axes: dict[str, tuple[int, ...]] | None = None) -> PlanReport:
    """`plan()` as `fewbits plan` answers it: PlanError when the weights alone cannot fit, the sweep added
    under "sweep" when `sweep_axes` is given.  Empty or None table lists take the default table."""
    r = plan(model, device, batch, context, weights, kv, devices, profile, activations,
             table_weights or TABLE_WEIGHTS, table_kv or TABLE_KV, misfit, lm_head)
    msg = weights_fit_message(r)
    if msg is not None:
        raise PlanError(msg)
    data = r.to_dict()
    lines: list[str] = []
    if sweep_axes is not None:
        lines, data["sweep"] = sweep_report(r, model, device, profile, activations, devices, sweep_axes, misfit,
                                            lm_head)
    return PlanReport(r, data, lines)
