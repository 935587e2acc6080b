"""`plan()`: one answer for a model, a device, a batch and a context in given formats.

Returns a `PlanResult` (step breakdown, speed against BF16, memory fit, the context where the cache
outweighs the weights, time to first token, and a table of weight x KV formats).  Byte figures are
totals over the devices; times are per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fewbits.cost.devices import DeviceSpec, get_device
from fewbits.cost.profile import Profile, load_profile
from fewbits.cost.step import decode, kv_terms, memory, prefill, weight_terms
from fewbits.formats.format import parse_format
from fewbits.models.presets import resolve_model
from fewbits.models.spec import ModelSpec

TABLE_WEIGHTS = ("bf16", "fp8-e4m3", "int8", "int4-g128")
TABLE_KV = ("bf16", "fp8-e4m3")


class PlanError(ValueError):
    """Inputs the cost model cannot answer for (non-positive sizes, weights that cannot fit)."""


@dataclass(frozen=True)
class TableRow:
    weights: str
    kv: str
    time_s: float
    tokens_per_s: float
    speedup: float
    weight_bytes: float
    kv_bytes: float
    bound: str
    fits: bool


@dataclass(frozen=True)
class PlanResult:
    model: str
    device: str
    devices: int
    profile: str
    weights: str
    kv: str
    precision: str
    batch: int
    context: int
    weight_bytes: float  # read per step (linear layers incl. LM head, embedding rows)
    kv_read_bytes: float
    kv_write_bytes: float
    kv_bytes: float
    bytes: float
    flops: float
    t_memory_s: float
    t_compute_s: float
    t_linear_s: float  # the linear layers' roofline: max(their memory time, their compute time)
    t_attention_s: float  # the attention's roofline over the cache
    t_comm_s: float
    overhead_s: float
    time_s: float
    bound: str
    tokens_per_s: float
    bf16_time_s: float
    speedup: float
    ttft_s: float  # prefill of one prompt of `context` tokens
    prefill_batch_s: float  # prefill of all `batch` prompts at once
    memory_weights: float
    memory_kv: float
    memory_headroom: float
    memory_need: float
    memory_capacity: float
    fits: bool
    weights_fit: bool
    max_batch: int
    max_context: int
    crossover_tokens: float  # cached tokens in the batch at which the cache read equals the weight bytes
    kv_bits_per_value: float
    notes: tuple[str, ...] = ()
    table: tuple[TableRow, ...] = ()
    lm_head: str | None = None  # the LM head's own format where it is quantised apart (`plan(lm_head=...)`)
    bandwidth: float = 0.0  # bytes/s the step reads its cache at (`Profile.bandwidth_at` its whole working set)
    weights_bandwidth: float = 0.0  # bytes/s it reads its weights at (the bandwidth at their own working set)
    memory_bandwidth: float = 0.0  # the device's own (memory's) bytes/s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["table"] = [asdict(r) for r in self.table]
        return d


def _f(x: Any) -> float:
    return float(x)


def _bound(st: dict[str, Any]) -> str:
    """What sets a step's time: "host" (launching it, on a GPU whose work overlaps), else "compute" or "memory"."""
    if bool(st["host_bound"]):
        return "host"
    return "compute" if bool(st["compute_bound"]) else "memory"


def plan(model: str | Path | ModelSpec, device: str | DeviceSpec | None = None, batch: int = 1,
         context: int = 2048, weights: str = "bf16", kv: str = "bf16", devices: int = 1,
         profile: str | Path | Profile = "default", activations: str = "auto",
         table_weights: tuple[str, ...] | None = TABLE_WEIGHTS,
         table_kv: tuple[str, ...] | None = TABLE_KV, misfit: str = "error",
         lm_head: str | None = None) -> PlanResult:
    """Predict a decode step of `batch` sequences with `context` cached tokens each.

    `misfit` is what a layer whose width the format's group size does not divide gets, as `fewbits quantize
    --misfit` does it: "error" (the default), "regroup" (the largest group size that divides) or "keep" (16-bit).
    `lm_head` is the LM head's own format (`fewbits quantize --lm-head`); None keeps the profile's convention.

    `device` defaults to the profile's measured device, else the H100 SXM.  `table_weights`/`table_kv`
    list the formats of the comparison table (the chosen `weights`/`kv` are always added); None skips it.
    """
    prof = load_profile(profile)
    spec = resolve_model(model)
    dev = pick_device(device, prof)
    for what, v in (("batch", batch), ("context", context), ("devices", devices)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise PlanError(f"{what} must be a positive integer, got {v!r}")
    weights = parse_format(weights).spec
    lm_head = parse_format(lm_head).spec if lm_head is not None else None
    w = weight_terms(spec, weights, dev, prof, devices, activations, misfit, lm_head)
    k = kv_terms(spec, kv, prof, devices)
    kv = k.spec
    st = decode(spec, dev, prof, w, k, batch, context, devices)
    w16 = weight_terms(spec, "bf16", dev, prof, devices)
    k16 = kv_terms(spec, "bf16", prof, devices)
    t16 = _f(decode(spec, dev, prof, w16, k16, batch, context, devices)["time"])
    mem = memory(dev, prof, w, k, batch, context)
    n = devices
    notes = _notes(spec, dev, prof, weights, kv, w.precision, k.bits, context, activations)
    if k.residual > 0:
        notes[0] = (f"KV cache {kv}: {k.bits:g} bits per quantised value (scales included); the {k.residual:g} to "
                    f"{k.residual + k.block - 1:g} most recent tokens stay 16-bit, as the store keeps them")
    rows: list[TableRow] = []
    if table_weights is not None and table_kv is not None:
        for wf in dict.fromkeys((*table_weights, weights)):
            try:
                wt = weight_terms(spec, wf, dev, prof, devices, activations, misfit, lm_head)
            except ValueError as e:  # a format whose groups do not divide this model's shapes
                notes.append(f"table: {wf} skipped ({e})")
                continue
            for kf in dict.fromkeys((*table_kv, kv)):
                kt = kv_terms(spec, kf, prof, devices)
                r = decode(spec, dev, prof, wt, kt, batch, context, devices)
                fit = memory(dev, prof, wt, kt, batch, context)["fits"]
                rows.append(TableRow(wt.spec, kt.spec, _f(r["time"]), _f(r["tokens_per_s"]), t16 / _f(r["time"]),
                                     _f(r["weight_bytes"]) * n, _f(r["kv_bytes"]) * n,
                                     _bound(r), bool(fit)))
    return PlanResult(
        model=spec.name, device=dev.name, devices=n, profile=prof.name, weights=weights, kv=kv,
        precision=w.precision, batch=batch, context=context,
        weight_bytes=_f(st["weight_bytes"]) * n, kv_read_bytes=_f(st["kv_read_bytes"]) * n,
        kv_write_bytes=_f(st["kv_write_bytes"]) * n, kv_bytes=_f(st["kv_bytes"]) * n, bytes=_f(st["bytes"]) * n,
        flops=_f(st["flops"]) * n, t_memory_s=_f(st["t_memory"]), t_compute_s=_f(st["t_compute"]),
        t_linear_s=_f(st["t_linear"]), t_attention_s=_f(st["t_attention"]), t_comm_s=_f(st["t_comm"]),
        overhead_s=_f(st["t_overhead"]), time_s=_f(st["time"]),
        bound=_bound(st), tokens_per_s=_f(st["tokens_per_s"]),
        bf16_time_s=t16, speedup=t16 / _f(st["time"]),
        ttft_s=_f(prefill(spec, dev, prof, w, k, 1, context, devices)["time"]),
        prefill_batch_s=_f(prefill(spec, dev, prof, w, k, batch, context, devices)["time"]),
        memory_weights=_f(mem["weights"]) * n, memory_kv=_f(mem["kv"]) * n, memory_headroom=_f(mem["headroom"]) * n,
        memory_need=_f(mem["need"]) * n, memory_capacity=dev.memory_bytes * n, fits=bool(mem["fits"]),
        weights_fit=w.stored <= _f(mem["usable"]), max_batch=int(mem["max_batch"]),
        max_context=int(mem["max_context"]), crossover_tokens=_f(st["weight_bytes"]) / k.per_token,
        kv_bits_per_value=k.bits, notes=tuple(notes), table=tuple(rows), lm_head=lm_head,
        bandwidth=_f(st["bandwidth"]), weights_bandwidth=_f(st["weights_bandwidth"]), memory_bandwidth=dev.bandwidth)


def pick_device(device: str | DeviceSpec | None, prof: Profile) -> DeviceSpec:
    """The device to cost: a DeviceSpec as given; the profile's measured device when `device` is None,
    'profile' or its key; else the table entry (default h100)."""
    if isinstance(device, DeviceSpec):
        return device
    if prof.device is not None and (device is None or device.lower() in ("profile", prof.device.key)):
        return prof.device
    return get_device(device or "h100")


def _notes(spec: ModelSpec, dev: DeviceSpec, prof: Profile, weights: str, kv: str, precision: str,
           kv_bits: float, context: int, activations: str) -> list[str]:
    notes = [f"KV cache {kv}: {kv_bits:g} bits per cached value (ideal: per-tensor/channel scales of a large "
             "cache negligible, group scales included)"]
    fmt = parse_format(weights)
    if fmt.is_quantized:
        if precision == "bf16":
            wanted = activations if activations != "auto" else {"fp8": "fp8", "mxfp8": "fp8"}.get(fmt.kind)
            if wanted and wanted != "bf16" and not dev.has(wanted):
                notes.append(f"{dev.name} has no {wanted} units: {weights} multiplies in BF16")
            else:
                notes.append(f"{weights} is weight-only here: dequantised, multiplied in BF16")
        else:
            notes.append(f"{weights} with {precision} activations: matrix multiplies on {precision} units")
    if spec.max_position_embeddings and context > spec.max_position_embeddings:
        notes.append(f"context {context} exceeds the model's {spec.max_position_embeddings} positions")
    if spec.is_moe:
        notes.append(f"MoE: {spec.n_experts} experts, {spec.experts_per_token} per token; decode reads the "
                     "experts the batch touches (uniform routing)")
    return notes


def _gb(x: float) -> str:
    if 0 < abs(x) < 1e7:
        return f"{x / 1e6:.2f} MB"
    return f"{x / 1e9:.2f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"


def format_plan_text(r: PlanResult) -> str:
    """A short human summary (a few lines) of one plan."""
    dev = f"{r.devices} x {r.device}" if r.devices > 1 else r.device
    fit = "fits" if r.fits else "DOES NOT FIT"
    return "\n".join([
        f"{r.model} on {dev}, weights {r.weights}{f' (LM head {r.lm_head})' if r.lm_head else ''}, KV {r.kv}, "
        f"batch {r.batch} x context {r.context} "
        f"(profile {r.profile})",
        f"  decode step {_ms(r.time_s)}, {r.tokens_per_s:.0f} tok/s, {r.bound}-bound, {r.speedup:.2f}x BF16",
        f"  bytes/step: weights {_gb(r.weight_bytes)} + KV {_gb(r.kv_bytes)} = {_gb(r.bytes)}",
        f"  memory: {_gb(r.memory_weights)} of weights + {_gb(r.memory_kv)} of cache = "
        f"{_gb(r.memory_weights + r.memory_kv)} of {r.memory_capacity / 1e9:.0f} GB "
        f"({_gb(r.memory_headroom)} kept free): {fit}",
        f"  time to first token ({r.context}-token prompt): {_ms(r.ttft_s)}",
    ])


def format_breakdown(r: PlanResult) -> str:
    """The full report of `fewbits plan`: summary, step breakdown, limits and the format table."""
    lines = [format_plan_text(r), "", "step breakdown:",
             f"  weights read      {_gb(r.weight_bytes)}",
             f"  KV read / written {_gb(r.kv_read_bytes)} / {_gb(r.kv_write_bytes)}",
             f"  FLOPs             {r.flops / 1e12:.3f} TFLOP on {r.precision} units",
             f"  memory time       {_ms(r.t_memory_s)}" + (
                 f"   (weights read at {r.weights_bandwidth / 1e9:.1f} GB/s, the cache at {r.bandwidth / 1e9:.1f}: "
                 f"the bandwidth at each one's working set; memory {r.memory_bandwidth / 1e9:.1f} GB/s)"
                 if max(r.bandwidth, r.weights_bandwidth) > r.memory_bandwidth * 1.001 else ""),
             f"  compute time      {_ms(r.t_compute_s)}",
             f"  linear layers     {_ms(r.t_linear_s)}   (the larger of their memory and compute times)",
             f"  attention         {_ms(r.t_attention_s)}",
             f"  all-reduce time   {_ms(r.t_comm_s)}",
             f"  overhead          {_ms(r.overhead_s)}",
             f"  step              {_ms(r.time_s)} ({r.bound}-bound; BF16 {_ms(r.bf16_time_s)})",
             "", "limits:",
             f"  max batch at context {r.context}: {r.max_batch}",
             f"  max context at batch {r.batch}: {r.max_context}",
             f"  the cache outweighs the weights beyond {r.crossover_tokens:,.0f} cached tokens in the batch "
             f"({r.crossover_tokens / r.batch:,.0f} per sequence)",
             f"  prefill of the whole batch: {_ms(r.prefill_batch_s)}"]
    if r.table:
        ww = max(14, *(len(t.weights) + 1 for t in r.table))  # long specs (int4-g32-r128) keep columns aligned
        kw = max(10, *(len(t.kv) + 1 for t in r.table))
        lines += ["", f"{'weights':<{ww}}{'KV':<{kw}}{'step':>11}{'tok/s':>9}{'speedup':>9}"
                      f"{'W GB':>8}{'KV GB':>8}  bound    fits"]
        for t in r.table:
            lines.append(f"{t.weights:<{ww}}{t.kv:<{kw}}{_ms(t.time_s):>11}{t.tokens_per_s:>9.0f}{t.speedup:>8.2f}x"
                         f"{t.weight_bytes / 1e9:>8.2f}{t.kv_bytes / 1e9:>8.2f}  {t.bound:<8} "
                         f"{'yes' if t.fits else 'no'}")
    lines += ["", *(f"note: {n}" for n in r.notes)]
    return "\n".join(lines)
