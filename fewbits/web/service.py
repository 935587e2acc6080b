"""The decode explorer's answer: `fewbits plan --json` plus the strings and chart series the page shows.

Every number comes from `fewbits.cost` (the report is `plan_report()`, the very dictionary `fewbits plan
--json` prints); this module only picks which library calls to make and writes their results as text, so
the page needs no arithmetic of its own.  Pure Python + numpy: no torch, no web framework.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from fewbits.cost.plan import PlanResult, pick_device, plan
from fewbits.cost.profile import Profile, load_profile
from fewbits.cost.report import plan_report
from fewbits.cost.sweep import sweep
from fewbits.models.spec import ModelSpec

#: the explorer's opening state: seed 000's widget (Llama-3-8B on one H100, batch 16, 4096 tokens each)
DEFAULT_STATE: dict[str, Any] = {
    "model": "llama-3-8b", "device": "h100", "weights": "bf16", "kv": "bf16", "batch": 16, "context": 4096,
    "devices": 1, "profile": "seed", "table_weights": ["bf16", "int8", "int4"], "table_kv": ["bf16", "fp8-e4m3"],
    "sweep_axis": "context",
}
SWEEP_CONTEXT = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class ExploreInputs:
    """One state of the explorer, resolved: `model` and `profile` may be objects the server holds."""

    model: str | ModelSpec
    device: str
    weights: str
    kv: str
    batch: int
    context: int
    devices: int
    profile: str | Profile
    table_weights: tuple[str, ...]
    table_kv: tuple[str, ...]
    sweep_axis: str = "context"
    model_arg: str = ""  # what `fewbits plan --model` takes for this model (a file name for a dropped config)
    profile_arg: str = ""  # what `--profile` takes (a path for a probed profile)
    extra: dict[str, Any] = field(default_factory=dict)


def gb(x: float) -> str:
    """Bytes as the seed writes them: '15.01 GB'."""
    return f"{x / 1e9:.2f} GB"


def ms(x: float, digits: int = 2) -> str:
    """Seconds as milliseconds: '9.31 ms'."""
    return f"{x * 1e3:.{digits}f} ms"


def memory_line(r: PlanResult) -> str:
    """'16.06 GB of weights + 8.59 GB of cache = 24.65 GB of 80 GB. Fits.' and, when it does not fit, what does."""
    total = r.memory_weights + r.memory_kv
    line = f"{gb(r.memory_weights)} of weights + {gb(r.memory_kv)} of cache = {gb(total)} of " \
           f"{r.memory_capacity / 1e9:.0f} GB"
    if r.memory_headroom > 0:
        line += f" ({gb(r.memory_headroom)} kept free)"
    if r.fits:
        return line + ". Fits."
    return (line + f". Does not fit: at context {r.context:,} at most batch {r.max_batch:,} fits; at batch "
            f"{r.batch:,} at most {r.max_context:,} tokens of context.")


def plan_command(s: ExploreInputs) -> str:
    """The `fewbits plan` command line that prints this state's numbers."""
    args = ["fewbits", "plan", "--model", s.model_arg or str(s.model), "--device", s.device,
            "--batch", str(s.batch), "--context", str(s.context), "--weights", s.weights, "--kv", s.kv]
    if s.devices != 1:
        args += ["--devices", str(s.devices)]
    args += ["--profile", s.profile_arg or str(s.profile), "--table-weights", ",".join(s.table_weights),
             "--table-kv", ",".join(s.table_kv)]
    return shlex.join(args)


def _bars(s: ExploreInputs, report: dict[str, Any]) -> list[dict[str, Any]]:
    """One bar per weight x KV pair of the table: the step split into linear layers (weights), attention
    (cache) and the rest (overhead, all-reduce), each from `plan()` for that pair."""
    bars = []
    for row in report["table"]:
        p = plan(s.model, s.device, s.batch, s.context, row["weights"], row["kv"], s.devices, s.profile,
                 table_weights=None, table_kv=None)
        bars.append({"label": f"W {row['weights']} · KV {row['kv']}", "weights": row["weights"], "kv": row["kv"],
                     "weights_ms": p.t_linear_s * 1e3, "cache_ms": p.t_attention_s * 1e3,
                     "overhead_ms": (p.overhead_s + p.t_comm_s) * 1e3, "time_ms": row["time_s"] * 1e3,
                     "text": ms(row["time_s"], 1), "fits": row["fits"], "bound": row["bound"],
                     "weight_gb": row["weight_bytes"] / 1e9, "kv_gb": row["kv_bytes"] / 1e9})
    return bars


def _sweep(s: ExploreInputs, r: PlanResult) -> dict[str, Any]:
    """Tokens/s against context per sequence (or batch), one line per weight format at the chosen KV format,
    from `fewbits.cost.sweep.sweep`; `crossover` is where the chosen pair's cache outweighs its weights."""
    formats = tuple(dict.fromkeys((*s.table_weights, r.weights)))
    if s.sweep_axis == "batch":
        xs, batch, context = SWEEP_BATCH, SWEEP_BATCH, (s.context,)
        crossover = r.crossover_tokens / r.context
    else:
        xs, batch, context = SWEEP_CONTEXT, (s.batch,), SWEEP_CONTEXT
        crossover = r.crossover_tokens / r.batch
    res = sweep(s.model, pick_device(s.device, load_profile(s.profile)), batch, context, formats, (r.kv,),
                s.devices, s.profile)
    lines = []
    for i, wf in enumerate(res.weights):
        tps = res.tokens_per_s[i, 0].reshape(-1)
        fits = res.fits[i, 0].reshape(-1)
        lines.append({"label": f"W {wf} · KV {res.kv[0]}", "tokens_per_s": [float(v) for v in tps],
                      "fits": [bool(v) for v in fits]})
    return {"axis": s.sweep_axis, "x": list(xs), "lines": lines,
            "crossover": crossover if math.isfinite(crossover) else None,
            "crossover_text": f"the cache outweighs the weights beyond {crossover:,.0f} "
                              f"{'sequences' if s.sweep_axis == 'batch' else 'tokens per sequence'} "
                              f"(W {r.weights} · KV {r.kv})"}


def explore(s: ExploreInputs) -> dict[str, Any]:
    """Everything the explorer shows for one state (ValueError subclasses for inputs the model refuses)."""
    rep = plan_report(s.model, s.device, s.batch, s.context, s.weights, s.kv, s.devices, s.profile,
                      table_weights=s.table_weights, table_kv=s.table_kv)
    r = rep.result
    base = plan(s.model, s.device, s.batch, s.context, "bf16", "bf16", s.devices, s.profile,
                table_weights=None, table_kv=None)
    view = {
        "weight_bytes": gb(r.weight_bytes), "weight_bytes_bf16": f"was {gb(base.weight_bytes)}",
        "kv_bytes": gb(r.kv_bytes), "kv_bytes_bf16": f"was {gb(base.kv_bytes)}",
        "time": ms(r.time_s), "time_note": f"{r.bound}-bound; was {ms(base.time_s)}",
        "tokens_per_s": f"{r.tokens_per_s:.0f}", "speedup": f"{r.speedup:.2f}× BF16",
        "memory": memory_line(r), "fits": r.fits,
        "title": f"{r.model} on {r.devices}× {r.device} (profile {r.profile})",
        "notes": list(r.notes),
    }
    return {"report": rep.data, "view": view, "bars": _bars(s, rep.data), "sweep": _sweep(s, r),
            "command": plan_command(s)}


def options(profiles: dict[str, tuple[Profile, str]] | None = None) -> dict[str, Any]:
    """The choices of the explorer and the playground: models, devices, formats, profiles, defaults."""
    from fewbits.cost.devices import DEVICES
    from fewbits.eval.playground import FAMILIES, GROUPS
    from fewbits.formats.format import EXAMPLE_SPECS
    from fewbits.formats.kvformat import KV_SPECS
    from fewbits.models.presets import preset_names

    kv = list(dict.fromkeys((*KV_SPECS, "fp16", "int8-r0", "fp8-e4m3-r0", "int4-g32-r128", "int2-g32-r128")))
    devices = {"h100": DEVICES["h100-sxm"].name, **{k: d.name for k, d in DEVICES.items()}}
    if profiles:  # `--device profile`: the device a probed profile measured
        devices["profile"] = "the probed profile's own device"
    return {
        "models": preset_names(), "devices": devices,
        "weights": [s for s in EXAMPLE_SPECS if s != "fp32"], "kv": kv,
        "profiles": ["seed", "default", *sorted(profiles or {})], "defaults": DEFAULT_STATE,
        "families": dict(FAMILIES), "groups": list(GROUPS),
    }
