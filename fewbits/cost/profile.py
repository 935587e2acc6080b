"""Efficiency profiles: how far below the datasheet a real step runs, as explicit numbers.

A profile says, per *format family* of the weights (and of the KV cache), which fraction of peak
memory bandwidth the bytes stream at and which fraction of peak FLOP/s the maths reaches, plus a fixed
overhead per step and the memory kept free.  Two profiles are built in:

* ``seed``: the textbook roofline: every byte at 0.8 of peak bandwidth, 0.5 ms per step, ideal byte
  counts (8-bit = 1 byte, 4-bit = 0.5 byte per weight, scales negligible), LM head and embedding rows
  in the weight format, no norms or biases, BF16 maths only, no memory headroom.
* ``default``: realistic serving: LM head and embeddings stay BF16, exact bytes incl. scales, 10%
  memory headroom, and dequantising formats stream at a lower fraction of peak.  The bandwidth
  efficiencies are fitted to TensorRT-LLM measurements of Llama-3-8B on one H100 at batch 1
  (FP8 1.26x and INT4-AWQ 1.53x over BF16, where the bytes alone suggest about 1.7x and 2.6x).

JSON schema (``"schema": "fewbits.profile"``, ``"version": 1``), every key but ``name`` optional
(a missing key takes the ``default`` profile's value)::

    {
      "schema": "fewbits.profile", "version": 1,
      "name": "my-h100",                      # shown in reports
      "description": "...",
      "bandwidth_efficiency": {"float": 0.8, "fp8": 0.52, "int8": 0.5, "int4": 0.34, "fp4": 0.34},
      "head_bandwidth_efficiency": 0.66,      # the 16-bit parts every format keeps (LM head, router, norms)
                                              #   where measured apart from the 16-bit linears; 0: "float"'s
      "head_compute_efficiency": 0.1,         # the 16-bit LM head's matmul where it was compute-limited at 8
                                              #   rows (measured): the head then has a roofline of its own and
                                              #   compute_efficiency is the other linears'; 0: in the family's
      "kv_bandwidth_efficiency": {"float": 0.8, "fp8": 0.75, ...},   # by the family of the KV format
      "kv_compute_measured": false,           # true: those were timed on decode steps of the attention itself
                                              #   (`fewbits probe`), so its maths is in them: a decode step's
                                              #   attention is its cache bytes at them, no FLOP roofline on top
      "compute_efficiency": {"float": 0.65, ...},                    # by the family of the weights
      "overhead_s": 0.0003,                   # fixed time per step (launches, sampling, scheduling)
      "overhead_per_seq_s": 0.0,              # added per sequence of the batch beyond the first
      "width_overhead_s": 2e-12,              # per layer and element of a row's width (hidden + intermediate):
      "width_overhead_per_seq_s": 1e-12,      #   the work between the matmuls (norms, residuals, the MLP's gate)
                                              #   at batch 1, and added per sequence beyond the first
      "linear_call_overhead_s": {"int4": 2e-6},  # extra time per linear call of a weight family (vs float)
      "linear_call_per_seq_s": {"int8": 6e-7},  # more per linear call and sequence beyond the first (the
                                              #   kernel's own fixed work growing with the rows: packing x,
                                              #   the tiles' drain), every family its own, "float" included
      "kv_layer_overhead_s": {"int8": 5e-5},  # extra time per layer and step of a KV family (vs float)
      "kv_quantized_overhead_s": {"int4": 2e-4},  # more per layer while the cache holds quantised tokens
      "kv_window_bandwidth_efficiency": {"int4": 0.3},  # the 16-bit window of a KIVI cache (copied each step)
      "kv_batch_factor": [[1, 1.5], [8, 1.0]],  # measured [batch, x]: the cache's time per byte at a batch, x its
                                              #   efficiency's (which is the largest batch's); between the
                                              #   batches interpolated in log batch, flat outside them
      "cache_refill_s": 1e-4,                 # per layer: small operations re-fetching what the layer's
      "cache_refill_bytes": 2097152,          #   stream evicted, x min(1, layer bytes / cache_refill_bytes)
      "cache_refill_curve": [[1048576, 1.1e-4], [4194304, 2.7e-4]],  # measured [layer bytes, seconds per
                                              #   layer] points; when given, replaces the line above
      "bandwidth_curve": [[67108864, 4.6e10], [268435456, 2.8e10]],  # measured [working-set bytes, read
                                              #   bytes/s]: a step whose weights and cache fit the last-level
                                              #   cache reads its weights faster than device.bandwidth
      "memory_headroom": 0.1,                 # fraction of device memory not available to weights+KV
      "weight_bytes": "exact" | "ideal",      # Format.nbytes(shape) vs Format.bits_per_weight()
      "quantize_lm_head": false, "quantize_embeddings": false,
      "count_norms_and_biases": true,         # read norm/bias vectors every step
      "low_precision_compute": true,          # W8A8/W4A4 maths on 8-/4-bit units where the device has them
      "host_overlap": false,                  # true: the host queues work that a GPU runs meanwhile, so a step
                                              #   takes max(overheads, device time) instead of their sum
      "device": null | {DeviceSpec.to_dict()},# measured figures replacing the datasheet
      "measured": {}                          # free-form provenance: host, date, method, raw numbers
    }

The overhead terms make the step model fit hosts where a step is not only bytes: on a CPU
with an eager framework, every call of a quantised kernel costs more than a 16-bit matmul call and
a quantised KV cache quantises and dequantises on every layer (a KIVI cache only once its 16-bit
window has overflowed, and it copies the window every step).  And a step's thousands of small
operations run from the core's cache until a layer streams its weights and keys/values through it:
each layer then pays ``cache_refill_s`` x min(1, bytes it streams / ``cache_refill_bytes``) to fetch
their working set again (on a CPU the stream of a small batch's cache is what sets this apart from
a large batch's; ``cache_refill_bytes`` is the core's L2 size).  Where the probe measured the refill at
several stream sizes (``cache_refill_curve``), it is interpolated linearly between them instead (0 at
0 bytes, flat beyond the last point): the loss is not a ramp that stops at the L2 size, it keeps
growing to about twice that and slowly after.  `fewbits probe` measures them; the
built-in profiles leave them at zero.

A decode step reads the same weights every step, so where they and the cache fit in the last-level cache
(a small model on a server CPU with hundreds of MB of L3) the weights stream from there, faster than from
memory.  ``bandwidth_curve`` holds the read bandwidth the probe measured over working sets of several sizes;
the step model reads weights and cache at `Profile.bandwidth_at` the step's own bytes (interpolated in log
bytes, never below ``device.bandwidth``; without a curve, ``device.bandwidth``), and the efficiencies are
relative to that rate (the probe measures the weights over one copy of the model, the cache in a skeleton
whose working set is the cache).

Families (`format_family`): "float" (bf16/fp16/fp32), "fp8" (fp8-*, mxfp8), "int8", "int4"
(int3..int7), "int2", "fp4" (fp4, nf4, mxfp4, nvfp4); an integer family with "+a8" ("int4+a8") is its kernels
that round the activations to int8 (`fewbits bench --activations q8`, the cost model's ``activations="int8"``;
on a CPU, `vpmaddubsw` / VNNI dot products, whose compute efficiency, relative to the 16-bit peak, may exceed 1).
A family missing from a table uses its fallback ("int4+a8" -> "int4", "int2" -> "int4"), then "float".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fewbits.cost.devices import DeviceSpec
from fewbits.formats.format import Format
from fewbits.models.spec import read_json_file

PROFILE_SCHEMA = "fewbits.profile"
PROFILE_VERSION = 1
FAMILIES = ("float", "fp8", "int8", "int4", "int2", "fp4")
#: where a family missing from a table looks next (before "float")
FALLBACK = {"int2": "int4", "int8+a8": "int8", "int4+a8": "int4", "int2+a8": "int2"}
#: the suffix of an integer family whose kernels round the activations to int8
A8 = "+a8"
#: the families of the measured tables: the formats' own and their int8-activation kernels'
MEASURED_FAMILIES = FAMILIES + ("int8+a8", "int4+a8", "int2+a8")
#: the most an int8-activation family's compute efficiency may be (relative to the 16-bit peak: integer dot
#: products do several times the multiply-adds of fp32 FMAs per instruction)
A8_COMPUTE_MAX = 4.0


def _lookup(table: dict[str, float], family: str, default: float) -> float:
    while family not in table and family in FALLBACK:
        family = FALLBACK[family]
    return table.get(family, default)


class ProfileError(ValueError):
    """A profile file or value that cannot be used."""


def format_family(fmt: Format, activations: str = "auto") -> str:
    """The efficiency family of a format (see the module docstring); int8 `activations` on an integer format: its
    "+a8" family."""
    fam = _weight_family(fmt)
    return fam + A8 if activations == "int8" and fam in ("int8", "int4", "int2") else fam


def _weight_family(fmt: Format) -> str:
    if fmt.kind == "float":
        return "float"
    if fmt.kind in ("fp8", "mxfp8"):
        return "fp8"
    if fmt.kind in ("int", "ggml"):  # llama.cpp's block types are integer codes with block scales
        return "int8" if fmt.bits == 8 else "int2" if fmt.bits <= 2 else "int4"
    return "fp4"


def curve_bandwidth(curve: tuple[tuple[float, float], ...], floor: float, nbytes: float | Any) -> float | Any:
    """The bandwidth of a [(working-set bytes, bytes/s)] curve at `nbytes` (array or scalar): interpolated in log
    bytes, its first value below its first point, `floor` (memory's rate) beyond its last point, never below
    `floor`."""
    import numpy as np

    x = np.log(np.maximum(np.asarray(nbytes, dtype=float), 1.0))
    if not curve:
        bw = np.full(np.shape(x), float(floor))
    else:
        xs = np.log([float(b) for b, _ in curve])
        bw = np.where(x > xs[-1], floor, np.interp(x, xs, [float(v) for _, v in curve]))
        bw = np.maximum(bw, floor)
    return float(bw) if np.ndim(nbytes) == 0 else bw


@dataclass(frozen=True)
class Profile:
    """Efficiencies and counting conventions for the step model (see the module docstring)."""

    name: str
    description: str = ""
    bandwidth_efficiency: dict[str, float] = field(default_factory=dict)
    kv_bandwidth_efficiency: dict[str, float] = field(default_factory=dict)
    kv_compute_measured: bool = False
    compute_efficiency: dict[str, float] = field(default_factory=dict)
    overhead_s: float = 0.0
    overhead_per_seq_s: float = 0.0
    width_overhead_s: float = 0.0
    width_overhead_per_seq_s: float = 0.0
    linear_call_overhead_s: dict[str, float] = field(default_factory=dict)
    linear_call_per_seq_s: dict[str, float] = field(default_factory=dict)
    kv_layer_overhead_s: dict[str, float] = field(default_factory=dict)
    kv_quantized_overhead_s: dict[str, float] = field(default_factory=dict)
    kv_window_bandwidth_efficiency: dict[str, float] = field(default_factory=dict)
    head_bandwidth_efficiency: float = 0.0
    head_compute_efficiency: float = 0.0
    cache_refill_s: float = 0.0
    cache_refill_bytes: float = 0.0
    cache_refill_curve: tuple[tuple[float, float], ...] = ()
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    kv_batch_factor: tuple[tuple[float, float], ...] = ()
    memory_headroom: float = 0.0
    weight_bytes: str = "exact"
    quantize_lm_head: bool = False
    quantize_embeddings: bool = False
    count_norms_and_biases: bool = True
    low_precision_compute: bool = True
    host_overlap: bool = False
    device: DeviceSpec | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for table in ("bandwidth_efficiency", "kv_bandwidth_efficiency", "compute_efficiency"):
            t = getattr(self, table)
            if "float" not in t:
                raise ProfileError(f"profile {self.name!r}: {table} needs a 'float' entry")
            for k, v in t.items():
                if k not in MEASURED_FAMILIES:
                    raise ProfileError(f"profile {self.name!r}: {table} has unknown family {k!r}; one of "
                                       f"{MEASURED_FAMILIES}")
                top = A8_COMPUTE_MAX if table == "compute_efficiency" and k.endswith(A8) else 1.0
                if not 0 < v <= top:
                    raise ProfileError(f"profile {self.name!r}: {table}[{k!r}] = {v} is not in (0, {top:g}]")
        for k, v in self.kv_window_bandwidth_efficiency.items():
            if k not in FAMILIES or not 0 < v <= 1:
                raise ProfileError(f"profile {self.name!r}: kv_window_bandwidth_efficiency[{k!r}] = {v}: a family of "
                                   f"{FAMILIES} and a value in (0, 1]")
        for table in ("linear_call_overhead_s", "linear_call_per_seq_s", "kv_layer_overhead_s",
                      "kv_quantized_overhead_s"):
            for k, v in getattr(self, table).items():
                if k not in MEASURED_FAMILIES:
                    raise ProfileError(f"profile {self.name!r}: {table} has unknown family {k!r}; one of "
                                       f"{MEASURED_FAMILIES}")
                if not math.isfinite(v):
                    raise ProfileError(f"profile {self.name!r}: {table}[{k!r}] = {v} is not finite")
        if not 0 <= self.head_bandwidth_efficiency <= 1:
            raise ProfileError(f"profile {self.name!r}: head_bandwidth_efficiency = {self.head_bandwidth_efficiency} "
                               "is not in (0, 1] (or 0: not measured)")
        if not 0 <= self.head_compute_efficiency <= 1:
            raise ProfileError(f"profile {self.name!r}: head_compute_efficiency = {self.head_compute_efficiency} "
                               "is not in (0, 1] (or 0: not measured)")
        if not (math.isfinite(self.cache_refill_s) and math.isfinite(self.cache_refill_bytes)) \
                or self.cache_refill_s < 0 or self.cache_refill_bytes < 0:
            raise ProfileError(f"profile {self.name!r}: cache_refill_s and cache_refill_bytes must be finite and >= 0")
        curve = self.cache_refill_curve
        if any(len(pt) != 2 or not all(math.isfinite(v) and v >= 0 for v in pt) for pt in curve) \
                or any(b[0] <= a[0] for a, b in zip(curve, curve[1:], strict=False)):
            raise ProfileError(f"profile {self.name!r}: cache_refill_curve must be [bytes, seconds] pairs, finite, "
                               f">= 0, bytes increasing; got {list(curve)}")
        bc = self.bandwidth_curve
        if any(len(pt) != 2 or not all(math.isfinite(v) and v > 0 for v in pt) for pt in bc) \
                or any(b[0] <= a[0] for a, b in zip(bc, bc[1:], strict=False)):
            raise ProfileError(f"profile {self.name!r}: bandwidth_curve must be [bytes, bytes/s] pairs, finite, "
                               f"> 0, bytes increasing; got {list(bc)}")
        kb = self.kv_batch_factor
        if any(len(pt) != 2 or not all(math.isfinite(v) and v > 0 for v in pt) for pt in kb) \
                or any(b[0] <= a[0] for a, b in zip(kb, kb[1:], strict=False)) or any(pt[0] < 1 for pt in kb):
            raise ProfileError(f"profile {self.name!r}: kv_batch_factor must be [batch, factor] pairs, finite, > 0, "
                               f"batches >= 1 and increasing; got {list(kb)}")
        if self.overhead_per_seq_s < 0:
            raise ProfileError(f"profile {self.name!r}: overhead_per_seq_s must be >= 0")
        for k in ("width_overhead_s", "width_overhead_per_seq_s"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v >= 0):
                raise ProfileError(f"profile {self.name!r}: {k} must be finite and >= 0, got {v}")
        if self.overhead_s < 0 or not 0 <= self.memory_headroom < 1:
            raise ProfileError(f"profile {self.name!r}: overhead_s must be >= 0 and memory_headroom in [0, 1)")
        if self.weight_bytes not in ("exact", "ideal"):
            raise ProfileError(f"profile {self.name!r}: weight_bytes is 'exact' or 'ideal', not {self.weight_bytes!r}")

    def bw_eff(self, family: str) -> float:
        return _lookup(self.bandwidth_efficiency, family, self.bandwidth_efficiency["float"])

    def bandwidth_at(self, device: DeviceSpec, nbytes: float | Any) -> float | Any:
        """Read bandwidth (bytes/s) of a step whose working set is `nbytes` (array or scalar): the measured
        `bandwidth_curve` at that size (`curve_bandwidth`), `device.bandwidth` without a curve."""
        return curve_bandwidth(self.bandwidth_curve, device.bandwidth, nbytes)

    def head_eff(self) -> float:
        """Bandwidth efficiency of the 16-bit parts every weight format keeps (the LM head, a router, norms):
        its own where measured (a large 2-d GEMV streams faster than a step's many 16-bit linears),
        else the 16-bit linears' `bw_eff("float")`."""
        return self.head_bandwidth_efficiency or self.bw_eff("float")

    def kv_eff(self, family: str) -> float:
        return _lookup(self.kv_bandwidth_efficiency, family, self.kv_bandwidth_efficiency["float"])

    def kv_batch_scale(self, batch: float | Any) -> float | Any:
        """How many times its efficiency's time a cache takes per byte at `batch` sequences (array or scalar):
        `kv_batch_factor` interpolated in log batch, flat outside its batches; 1 without it."""
        import numpy as np

        b = np.log(np.maximum(np.asarray(batch, dtype=float), 1.0))
        pts = self.kv_batch_factor
        f = np.interp(b, np.log([p[0] for p in pts]), [p[1] for p in pts]) if pts else np.ones(np.shape(b))
        return float(f) if np.ndim(batch) == 0 else f

    def compute_eff(self, family: str) -> float:
        return _lookup(self.compute_efficiency, family, self.compute_efficiency["float"])

    def call_overhead(self, family: str) -> float:
        """Extra seconds per call of a linear layer whose weights are in `family` (0 when not measured)."""
        return _lookup(self.linear_call_overhead_s, family, 0.0)

    def call_per_seq(self, family: str) -> float:
        """Seconds more per call of a linear layer in `family` for each sequence of the batch beyond the first (0
        when not measured)."""
        return _lookup(self.linear_call_per_seq_s, family, 0.0)

    def kv_overhead(self, family: str) -> float:
        """Extra seconds per layer and step of a KV cache in `family` (0 when not measured)."""
        return _lookup(self.kv_layer_overhead_s, family, 0.0)

    def kv_quantized_overhead(self, family: str) -> float:
        """Further seconds per layer and step while a cache in `family` holds quantised tokens (a cache
        with a 16-bit window holds none until the window first overflows; 0 when not measured)."""
        return _lookup(self.kv_quantized_overhead_s, family, 0.0)

    def kv_window_eff(self, family: str) -> float:
        """Bandwidth efficiency of the 16-bit window of a cache in `family` (default: the 16-bit cache's)."""
        return _lookup(self.kv_window_bandwidth_efficiency, family, self.kv_eff("float"))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "name": self.name,
                "description": self.description, "bandwidth_efficiency": dict(self.bandwidth_efficiency),
                "kv_bandwidth_efficiency": dict(self.kv_bandwidth_efficiency),
                "kv_compute_measured": self.kv_compute_measured,
                "compute_efficiency": dict(self.compute_efficiency), "overhead_s": self.overhead_s,
                "overhead_per_seq_s": self.overhead_per_seq_s,
                "width_overhead_s": self.width_overhead_s, "width_overhead_per_seq_s": self.width_overhead_per_seq_s,
                "linear_call_overhead_s": dict(self.linear_call_overhead_s),
                "linear_call_per_seq_s": dict(self.linear_call_per_seq_s),
                "kv_layer_overhead_s": dict(self.kv_layer_overhead_s),
                "kv_quantized_overhead_s": dict(self.kv_quantized_overhead_s),
                "kv_window_bandwidth_efficiency": dict(self.kv_window_bandwidth_efficiency),
                "head_bandwidth_efficiency": self.head_bandwidth_efficiency,
                "head_compute_efficiency": self.head_compute_efficiency,
                "cache_refill_s": self.cache_refill_s, "cache_refill_bytes": self.cache_refill_bytes,
                "cache_refill_curve": [list(pt) for pt in self.cache_refill_curve],
                "bandwidth_curve": [list(pt) for pt in self.bandwidth_curve],
                "kv_batch_factor": [list(pt) for pt in self.kv_batch_factor],
                "memory_headroom": self.memory_headroom, "weight_bytes": self.weight_bytes,
                "quantize_lm_head": self.quantize_lm_head, "quantize_embeddings": self.quantize_embeddings,
                "count_norms_and_biases": self.count_norms_and_biases,
                "low_precision_compute": self.low_precision_compute, "host_overlap": self.host_overlap,
                "device": self.device.to_dict() if self.device else None, "measured": dict(self.measured)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "profile") -> Profile:
        if d.get("schema", PROFILE_SCHEMA) != PROFILE_SCHEMA:
            raise ProfileError(f"{source}: schema {d.get('schema')!r} is not {PROFILE_SCHEMA!r}")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{source}: profile version {d.get('version')!r} is not supported "
                               f"(this fewbits reads {PROFILE_VERSION})")
        known = {"schema", "version", *cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"{source}: unknown profile keys {unknown}")
        if "name" not in d:
            raise ProfileError(f"{source}: the profile needs a 'name'")
        vals = {k: v for k, v in d.items() if k not in ("schema", "version")}
        base = DEFAULT
        for t in ("bandwidth_efficiency", "kv_bandwidth_efficiency", "compute_efficiency"):
            if t in vals:
                vals[t] = {**getattr(base, t), **{str(k): float(v) for k, v in vals[t].items()}}
        for t in ("linear_call_overhead_s", "linear_call_per_seq_s", "kv_layer_overhead_s", "kv_quantized_overhead_s",
                  "kv_window_bandwidth_efficiency"):
            if t in vals:
                vals[t] = {str(k): float(v) for k, v in vals[t].items()}
        for t, pair in (("cache_refill_curve", "bytes, seconds"), ("bandwidth_curve", "bytes, bytes/s"),
                        ("kv_batch_factor", "batch, factor")):
            if t in vals:
                try:
                    vals[t] = tuple((float(a), float(b)) for a, b in vals[t])
                except (TypeError, ValueError):
                    raise ProfileError(f"{source}: {t} must be a list of [{pair}] pairs, "
                                       f"got {vals[t]!r}") from None
        if vals.get("device") is not None:
            vals["device"] = DeviceSpec.from_dict(vals["device"])
        try:
            return replace(base, **vals)
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{source}: {e}") from None


def load_profile(name_or_path: str | Path | Profile) -> Profile:
    """'seed', 'default', a Profile, or the path of a profile JSON file."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    key = str(name_or_path)
    if key in BUILTIN:
        return BUILTIN[key]
    p = Path(key)
    if not p.is_file():
        raise ProfileError(f"profile {key!r} is neither built in ({', '.join(BUILTIN)}) nor a file")
    data = read_json_file(p, "profile", ProfileError)
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: a profile is a JSON object, got a {type(data).__name__}")
    return Profile.from_dict(data, source=str(p))


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` as JSON atomically (temporary file in the same folder, then rename)."""
    from fewbits.files import write_text  # stdlib only: the cost path stays free of torch

    write_text(path, json.dumps(profile.to_dict(), indent=2) + "\n")


_ALL = dict.fromkeys(FAMILIES, 0.8)
SEED = Profile(
    name="seed", description="roofline: 0.8 of peak bandwidth, 0.5 ms per step, ideal bytes, no dequantisation cost",
    bandwidth_efficiency=dict(_ALL), kv_bandwidth_efficiency=dict(_ALL), compute_efficiency=dict(_ALL),
    overhead_s=0.5e-3, memory_headroom=0.0, weight_bytes="ideal", quantize_lm_head=True,
    quantize_embeddings=True, count_norms_and_biases=False, low_precision_compute=False)

DEFAULT = Profile(
    name="default",
    description="serving-like: BF16 LM head and embeddings, exact bytes, 10% headroom; dequantising formats "
                "stream below peak (fitted to TensorRT-LLM Llama-3-8B/H100 batch-1 speedups)",
    # float: good GEMV kernels reach ~80% of HBM peak.  fp8 and int4 are fitted to the measured
    # 1.26x / 1.53x; int8 weight-only and fp4 are interpolated estimates (no measurement behind them).
    bandwidth_efficiency={"float": 0.80, "fp8": 0.52, "int8": 0.50, "int4": 0.34, "fp4": 0.34},
    # KV caches: estimates (no measurement behind them); quantised caches dequantise inside attention.
    kv_bandwidth_efficiency={"float": 0.80, "fp8": 0.75, "int8": 0.70, "int4": 0.55, "fp4": 0.55},
    # dense GEMMs reach ~65% of peak in prefill; weight-only formats pay for dequantisation in the loop.
    compute_efficiency={"float": 0.65, "fp8": 0.60, "int8": 0.55, "int4": 0.50, "fp4": 0.50},
    overhead_s=0.3e-3, memory_headroom=0.10, weight_bytes="exact", quantize_lm_head=False,
    quantize_embeddings=False, count_norms_and_biases=True, low_precision_compute=True)

BUILTIN: dict[str, Profile] = {"seed": SEED, "default": DEFAULT}
