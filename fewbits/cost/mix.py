"""Predicted decode time of a model whose linear layers are in different formats (a budgeted mix).

The step model (`fewbits.cost.step`) costs one weight format for every linear.  A mix is costed as a
fixed part plus one term per linear layer:

    t(mix) = t_fixed + sum_l t_l(format_l),     t_l(f) = bytes_f(shape_l) / (beta eta_w(f)) + call_f

(eta_w the profile's bandwidth efficiency of f's family, call_f its measured extra time per call),
with t_fixed = t(uniform `base`) - sum_l t_l(base) from the step model itself (attention over the
cache, the 16-bit head and embeddings, fixed overheads).  Additive terms are what the budget optimiser
(`fewbits.methods.budget`) needs; the price is the step model's non-linear parts (a compute-bound
roofline, the core-cache refill that grows with a layer's bytes, a GPU host that overlaps the device),
which the mix sees at the `base` format's value.  `uniform_check` reports how far the additive
prediction of each uniform candidate lies from the step model's own.  Batch-1 decode (memory-bound).

Pure Python + numpy: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import Profile, format_family
from fewbits.cost.step import decode, kv_terms, weight_terms
from fewbits.formats.format import Format, parse_format
from fewbits.models.spec import ModelSpec


def layer_time(fmt: str | Format, shape: tuple[int, int], device: DeviceSpec, profile: Profile) -> float:
    """Seconds one decode step spends on a linear of `shape` stored in `fmt` (batch 1, memory-bound)."""
    f = parse_format(fmt)
    fam = format_family(f)
    nbytes = f.nbytes(shape) if profile.weight_bytes == "exact" else shape[0] * shape[1] * f.bits_per_weight() / 8
    return nbytes / (device.bandwidth * profile.bw_eff(fam)) + profile.call_overhead(fam)


def _spec_layers(spec: ModelSpec) -> list[tuple[tuple[int, int], int]]:
    """(shape, count) of the linears the step model counts in the weight format (not head, router)."""
    return [(s.shape, s.count) for s in spec.linear_shapes() if s.role not in ("lm_head", "router")]


def uniform_time(spec: ModelSpec, fmt: str, device: DeviceSpec, profile: Profile, context: int) -> float:
    """The step model's batch-1 decode time with every linear in `fmt`, the head and the KV cache 16-bit
    (as `fewbits quantize --budget` leaves them, whatever the profile's `quantize_lm_head` convention)."""
    w = weight_terms(spec, fmt, device, profile, lm_head="bf16")
    k = kv_terms(spec, "bf16", profile)
    return float(decode(spec, device, profile, w, k, 1, context)["time"])


def fixed_time(spec: ModelSpec, base: str, device: DeviceSpec, profile: Profile, context: int) -> float:
    """t_fixed: the uniform `base` step less its linears' additive terms."""
    lin = sum(n * layer_time(base, shape, device, profile) for shape, n in _spec_layers(spec))
    return uniform_time(spec, base, device, profile, context) - lin


def mixed_time(spec: ModelSpec, layers: Sequence[tuple[tuple[int, int], str]], base: str, device: DeviceSpec,
               profile: Profile, context: int) -> float:
    """Predicted batch-1 decode step of the mix: `layers` lists (shape, format) of every linear."""
    return fixed_time(spec, base, device, profile, context) + sum(layer_time(f, s, device, profile)
                                                                  for s, f in layers)


def uniform_check(spec: ModelSpec, candidates: Sequence[str], base: str, device: DeviceSpec, profile: Profile,
                  context: int) -> dict[str, dict[str, float]]:
    """{format: {"step_model": s, "additive": s}}: each uniform candidate by the step model and by the
    additive model the budget uses."""
    t0 = fixed_time(spec, base, device, profile, context)
    out = {}
    for c in candidates:
        add = t0 + sum(n * layer_time(c, shape, device, profile) for shape, n in _spec_layers(spec))
        out[c] = {"step_model": uniform_time(spec, c, device, profile, context), "additive": add}
    return out
