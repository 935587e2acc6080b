"""The step model: bytes, FLOPs and time of a decode or prefill step, and the memory it needs.

A decode step over batch b with c cached tokens in total (c = b x context per sequence) reads

    B = W_linear(w) + b d w_emb + (c + b) kappa,     kappa = 2 L n_kv d_h b_kv  (bytes per token, GQA)

(linear weights incl. the LM head; one embedding row per sequence; the cache read, c kappa, and the new
keys/values written, b kappa) and does F = 2 b P_lin + 4 L n_h d_h (c + b) FLOPs.  A KV cache as fewbits
stores it (`fewbits.formats.kvformat`, e.g. KIVI int4 with a 16-bit residual window of R tokens quantised
G at a time) counts its true bytes instead: of a sequence's context, (context - R) // G * G tokens at
the quantised kappa and the rest at the 16-bit one, each part at its own efficiency.  With n-way tensor
parallelism weights, heads and KV heads split over the devices and each layer adds two ring
all-reduces of the b x d activations, each 2 (n-1)/n * bytes / link + latency.  The step takes

    t = max(B_w / (beta eta_w), F_lin / (peak eta_c))             linear layers (their own roofline)
      + max(B_kv / (beta eta_kv), F_att / (peak_16 eta_c16))        attention over the cache
      + t_comm + t_0                                                 all-reduces + fixed overhead

with eta from the `Profile` per format family.  Where the profile measured the 16-bit LM head's own compute
efficiency (`Profile.head_compute_efficiency`: on a CPU a 16-bit head of 8 rows is compute-limited while the
int4 linears beside it are not), that head is a roofline of its own, max(B_f / (beta eta_f), F_head / (peak_16
eta_ch)), added to the other linears' max(B_q / (beta eta_w), (F_lin - F_head) / (peak eta_c)).
The linears' and the attention's rooflines are summed, not merged into one,
because the kernels of a step run one after another: a batch whose linears are compute-bound still
streams its KV cache afterwards.  t_0 is `Profile.step_overhead`: a fixed time, a part per sequence
of the batch, and (measured hosts) the extra cost per call of the weight format's kernels and per
layer of the KV format, the work between the matmuls at the model's widths (norms, residuals, the MLP's
gate: L (hidden + intermediate) (w_0 + w_1 (b - 1)), `Profile.width_overhead_s`), and the refill of the core
cache each layer's stream (weights and 16-bit keys/values, x bytes) evicts: L E min(1, x / X), or L E(x) from
a measured curve (`refill_time`).
Mixture-of-experts layers read the experts the batch touches: E (1 - (1 - k/E)^b) per layer in
expectation under uniform routing.

A decode step's attention takes its bytes alone, without the FLOP roofline, where the profile's eta_kv were
timed on decode steps of the attention itself (`Profile.kv_compute_measured`, `fewbits probe`): its maths is then
in eta_kv already (a decode step does the same FLOPs per cached byte at any batch and context, so the two cannot
be told apart, nor need to be), and the linears' compute efficiency eta_c16 is no measure of the attention's.
Those steps also find a small batch reading its cache slower per byte than a large one (SmolLM2, 2 threads, 128
to 2048 tokens: at batch 1 1.4-1.7x batch 8's time per byte, in the 6- and 2-layer skeletons and in the model's
own steps alike), so B_kv / (beta eta_kv) is x `Profile.kv_batch_scale(b)`, eta_kv being the largest batch's.

Everything is numpy and broadcasts: b and context may be arrays, and so may the per-format terms
(`WeightTerms`/`KVTerms` fields), which is what `fewbits.cost.sweep` uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import Profile, format_family
from fewbits.formats.format import MISFIT_POLICIES, Format, FormatError, parse_format
from fewbits.formats.kvformat import KVFormat, parse_kv_format, quantized_tokens
from fewbits.models.spec import ModelSpec

ACT_BYTES = 2  # activations exchanged by all-reduces stay 16-bit
ACTIVATIONS = ("auto", "bf16", "fp16", "fp8", "int8", "fp4")


@dataclass(frozen=True)
class WeightTerms:
    """Per-device byte and FLOP figures of a model in one weight format (see `weight_terms`)."""

    spec: str
    family: str
    dense_q: float  # bytes per step of the quantised non-expert linears
    dense_f: float  # bytes per step kept at 16 bits (unquantised LM head, router, norms, biases)
    expert_layer: float  # bytes of one expert in one layer (all experts: L * E of these)
    emb_row: float  # bytes of one embedding row
    stored: float  # bytes of all weights held in memory (embeddings and norms included)
    linear_flops: float  # 2 x linear weights one token multiplies by (LM head incl.)
    precision: str  # the precision the matrix multiplies run in
    peak: float  # dense FLOP/s of that precision on the device
    eta_w: float  # bandwidth efficiency of the quantised weights
    eta_f: float  # bandwidth efficiency of the 16-bit parts (`Profile.head_eff`)
    eta_c: float  # compute efficiency
    linear_calls: float = 0.0  # calls of quantised non-expert linears per step
    expert_linears: float = 0.0  # linears of one expert in one layer (calls per touched expert)
    call_overhead_s: float = 0.0  # extra fixed time per call of a linear in this format (measured hosts)
    head_q: float = 0.0  # bytes per step of an LM head quantised in its own format (`lm_head`)
    eta_h: float = 1.0  # bandwidth efficiency of that head (its format family's)
    head_call_s: float = 0.0  # extra fixed time of that head's call (its family's call overhead)
    head_flops: float = 0.0  # 2 x the 16-bit LM head's weights (of linear_flops), where it has its own roofline
    eta_ch: float = 0.0  # that head's compute efficiency (`Profile.head_compute_efficiency`; 0: none of its own)
    call_per_seq_s: float = 0.0  # more per linear call and sequence beyond the first (`Profile.call_per_seq`)


@dataclass(frozen=True)
class KVTerms:
    """Per-device byte figures of a KV cache (see `kv_terms`).  A cache that keeps its most recent tokens
    in 16 bits (KIVI's residual window) holds `quantized_tokens(c, residual, block)` of c tokens at
    `per_token` bytes and the rest at `window_per_token`; other caches have residual 0 and block 1."""

    spec: str
    family: str
    bits: float  # stored bits per cached value of a quantised token (scales included where the format has them)
    per_token: float  # bytes per quantised token over all layers, per device
    eta: float
    layer_overhead_s: float = 0.0  # extra fixed time per layer and step of this KV format (measured hosts)
    residual: float = 0.0  # R: most recent tokens kept in 16 bits
    block: float = 1.0  # G: tokens quantised together when they leave the window
    window_per_token: float = 0.0  # bytes per 16-bit window token over all layers, per device
    window_eta: float = 1.0  # bandwidth efficiency of the window's bytes
    quantized_overhead_s: float = 0.0  # more per layer while the cache holds quantised tokens (measured hosts)


def compute_precision(fmt: Format, activations: str, device: DeviceSpec, profile: Profile) -> str:
    """Which units the matrix multiplies use.  Weight-only formats dequantise and multiply in BF16; W8A8
    (fp8 weights with fp8 activations, int8 with int8) and W4A4 use 8-/4-bit units where the device has them.
    "auto" means fp8 activations for fp8 weights, fp4 for nvfp4/mxfp4, BF16 otherwise."""
    if activations not in ACTIVATIONS:
        raise FormatError(f"activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    if activations == "auto":
        activations = {"fp8": "fp8", "mxfp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}.get(fmt.kind, "bf16")
    if fmt.kind == "float":
        return fmt.spec if fmt.spec in device.peak_flops else "bf16"
    if not profile.low_precision_compute or not device.has(activations):
        return "bf16"
    return activations


def _linear_bytes(fmt: Format, shape: tuple[int, int], count: int, profile: Profile, name: str) -> float:
    fmt.check_shape(shape, name)
    if profile.weight_bytes == "ideal":
        return count * shape[0] * shape[1] * fmt.bits_per_weight() / 8
    return float(count * fmt.nbytes(shape))


def fitted_format(fmt: Format, shape: tuple[int, int], misfit: str, name: str) -> Format | None:
    """The format a linear of `shape` is stored in under the misfit policy (as `Recipe` quantises it):
    `fmt` when it fits; else "error" raises naming the layer, "regroup" takes the largest group size that
    divides (`Format.regrouped`), and "keep" (or a block size that cannot change) keeps it 16-bit: None."""
    if misfit not in MISFIT_POLICIES:
        raise FormatError(f"misfit policy {misfit!r} is not one of {', '.join(MISFIT_POLICIES)}")
    if fmt.granularity == "group" and shape[1] % fmt.group_size:
        if misfit == "error":
            raise FormatError(f"{name}: last dimension {shape[1]} of shape {tuple(shape)} is not divisible by the "
                              f"group size {fmt.group_size} of format {fmt.spec} (misfit policy 'regroup' takes the "
                              "largest group that divides, 'keep' leaves the layer 16-bit: --misfit)")
        return fmt.regrouped(shape[1]) if misfit == "regroup" else None
    fmt.check_shape(shape, name)
    return fmt


def weight_terms(model: ModelSpec, weights: str | Format, device: DeviceSpec, profile: Profile,
                 devices: int = 1, activations: str = "auto", misfit: str = "error",
                 lm_head: str | Format | None = None) -> WeightTerms:
    """Bytes and FLOPs of `model` with its linear layers in `weights`, per device of `devices`.

    misfit: what a layer whose width the group size does not divide gets, as in quantisation
    (`fitted_format`): "error", "regroup" or "keep" (a kept layer's bytes stream with the 16-bit parts).
    lm_head: the LM head's own format, as `fewbits quantize --lm-head` stores it (None: the profile's
    `quantize_lm_head` decides).  A quantised head streams at its family's efficiency; tied to the input
    embedding, it is a copy of its own (the embedding keeps its 16-bit rows), so memory holds both."""
    fmt = parse_format(weights)
    base = fmt if fmt.kind == "float" else parse_format("bf16")
    head_fmt = parse_format(lm_head) if lm_head is not None else None
    if head_fmt is not None and not head_fmt.is_quantized:
        head_fmt = base  # asked for a 16-bit head
    n = devices
    dense_q = dense_f = expert = calls = expert_linears = head_q = head16 = 0.0
    head_own = None  # the fitted format of a head quantised in its own format
    for s in model.linear_shapes():
        name = f"{model.name}.{s.name}"
        if s.role == "lm_head" and head_fmt is not None and head_fmt.is_quantized:
            head_own = fitted_format(head_fmt, s.shape, misfit, name)
            if head_own is not None:
                head_q += _linear_bytes(head_own, s.shape, s.count, profile, name)
                continue
        if s.role == "router" or (s.role == "lm_head" and (not profile.quantize_lm_head or head_fmt is not None)):
            dense_f += _linear_bytes(base, s.shape, s.count, profile, name)
            if s.role == "lm_head":
                head16 += 2.0 * s.count * s.shape[0] * s.shape[1]
            continue
        f = fitted_format(fmt, s.shape, misfit, name)
        if f is None and s.role != "expert":  # kept 16-bit
            dense_f += _linear_bytes(base, s.shape, s.count, profile, name)
            calls += s.count
            continue
        f = f or base
        if s.role == "expert":
            expert += _linear_bytes(f, s.shape, s.count, profile, name)
            expert_linears += s.count / (model.n_layers * max(model.n_experts, 1))
        else:
            dense_q += _linear_bytes(f, s.shape, s.count, profile, name)
            calls += s.count
    small = (model.n_norm_params + model.n_bias_params) * base.bits / 8
    if profile.count_norms_and_biases:
        dense_f += small
    emb_fmt = fmt if profile.quantize_embeddings else base
    emb_bpv = emb_fmt.bits_per_weight() / 8 if profile.weight_bytes == "ideal" else (
        emb_fmt.nbytes((model.vocab_size, model.hidden_size)) / model.n_embedding_params)
    lm = next(s for s in model.linear_shapes() if s.role == "lm_head")
    lm_bytes = 0.0
    if lm.tied and head_own is None:  # the stored embedding is the LM head; count it once in memory
        lm_fmt = fmt if profile.quantize_lm_head and head_fmt is None else base
        lm_bytes = _linear_bytes(lm_fmt, lm.shape, 1, profile, f"{model.name}.lm_head")
    stored = dense_q + dense_f + expert + head_q - lm_bytes + model.n_embedding_params * emb_bpv
    if not profile.count_norms_and_biases:
        stored += small
    active_lin = model.n_linear_params() - (
        model.n_linear_params(("expert",)) * (model.n_experts - model.experts_per_token) // max(model.n_experts, 1))
    prec = compute_precision(fmt, activations, device, profile)
    fam = format_family(fmt, activations)
    per_expert_layer = expert / (model.n_layers * model.n_experts) if model.is_moe else 0.0
    return WeightTerms(fmt.spec, fam, dense_q / n, dense_f / n, per_expert_layer / n,
                       model.hidden_size * emb_bpv / n, stored / n, 2.0 * active_lin / n, prec, device.peak_flops[prec],
                       profile.bw_eff(fam), profile.head_eff(), profile.compute_eff(fam), calls / n,
                       expert_linears, profile.call_overhead(fam), head_q / n,
                       profile.bw_eff(format_family(head_own, activations)) if head_own else 1.0,
                       profile.call_overhead(format_family(head_own, activations)) if head_own else 0.0,
                       head16 / n if profile.head_compute_efficiency else 0.0, profile.head_compute_efficiency,
                       profile.call_per_seq(fam))


def resolve_kv(kv: str | Format | KVFormat) -> Format | KVFormat:
    """A KV spec: a weight-style format (``bf16``, ``fp8-e4m3``, ``int4``, ``int4-g32-asym``: its bits per
    value, no window) or, where the string is not one, a KV-cache format of `fewbits.formats.kvformat` written
    with its residual (``int4-g32-r128``, ``int2-r128``, ``int8-r0``, ``fp8-e4m3-r0``: `KVFormat.full_spec`,
    what `fewbits bench` passes), whose bytes are the store's own."""
    if isinstance(kv, (Format, KVFormat)):
        return kv
    try:
        return parse_format(kv)
    except FormatError as e:
        try:
            return parse_kv_format(kv)
        except FormatError:
            raise e from None


def kv_terms(model: ModelSpec, kv: str | Format | KVFormat, profile: Profile, devices: int = 1) -> KVTerms:
    """Bytes per cached token per device.  A weight-style format counts its asymptotic bits per value
    (`Format.bits_per_weight()` without a shape: per-tensor/per-channel scales of a large cache are
    negligible, group scales are included) for every token.  A KV-cache format counts what its store
    holds: `KVFormat.token_bytes` per quantised token (scales included) and 16 bits per window token."""
    fmt = resolve_kv(kv)
    kv_heads_per_device = math.ceil(model.n_kv_heads / devices)  # heads are replicated when n > n_kv
    if isinstance(fmt, KVFormat):
        fmt.check_head_dim(model.head_dim)
        q, w = fmt.token_bytes(model.head_dim)
        fam = format_family(fmt.cost_format(model.head_dim))
        heads = model.n_layers * kv_heads_per_device
        return KVTerms(fmt.full_spec, fam, 8 * q / (2 * model.head_dim), heads * q, profile.kv_eff(fam),
                       profile.kv_overhead(fam), float(fmt.residual), float(fmt.block), heads * w,
                       profile.kv_window_eff(fam), profile.kv_quantized_overhead(fam))
    if fmt.granularity == "group" and model.head_dim % fmt.group_size:
        raise FormatError(f"KV format {fmt.spec}: its group of {fmt.group_size} values does not divide the head size "
                          f"{model.head_dim} of {model.name} (each head's keys and values are grouped); use a group "
                          f"size that divides {model.head_dim}")
    bits = fmt.bits_per_weight()
    per_token = 2 * model.n_layers * kv_heads_per_device * model.head_dim * bits / 8
    fam = format_family(fmt)
    return KVTerms(fmt.spec, fam, bits, per_token, profile.kv_eff(fam), profile.kv_overhead(fam),
                   window_per_token=per_token, window_eta=profile.kv_window_eff(fam),
                   quantized_overhead_s=profile.kv_quantized_overhead(fam) if fmt.is_quantized else 0.0)


def kv_cache_bytes(kv: KVTerms, tokens: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """(quantised bytes, 16-bit window bytes) per device of one sequence's cache holding `tokens` tokens:
    exactly what the store reports (`KVFormat.nbytes`) for KV-cache formats."""
    t = np.asarray(tokens, dtype=float)
    tq = quantized_tokens(t, np.asarray(kv.residual), np.asarray(kv.block))
    return tq * kv.per_token, (t - tq) * kv.window_per_token


def kv_step_bytes(kv: KVTerms, batch: np.ndarray | int, context: np.ndarray | int
                  ) -> dict[str, np.ndarray]:
    """Cache bytes a decode step moves per device: the quantised part and the 16-bit part (window) of the
    read of `context` cached tokens per sequence, and of the write of the new token, which lands in the
    16-bit window where there is one and is quantised otherwise."""
    b = np.asarray(batch, dtype=float)
    ctx = np.asarray(context, dtype=float)
    tq = quantized_tokens(ctx, np.asarray(kv.residual), np.asarray(kv.block))
    windowed = np.asarray(kv.residual) > 0
    write = b * np.where(windowed, kv.window_per_token, kv.per_token)
    return {"read_q": (b * tq) * kv.per_token, "read_w": (b * (ctx - tq)) * kv.window_per_token,
            "write_q": np.where(windowed, 0.0, write), "write_w": np.where(windowed, write, 0.0)}


def _allreduce(device: DeviceSpec, devices: int, nbytes: np.ndarray) -> np.ndarray:
    """Ring all-reduce of `nbytes` over `devices`: 2 (n-1)/n * bytes / link bandwidth + latency."""
    if devices <= 1:
        return np.zeros_like(nbytes, dtype=float)
    if device.link_bandwidth <= 0:
        raise ValueError(f"device {device.key!r} has no link bandwidth for {devices}-way tensor parallelism")
    return 2 * (devices - 1) / devices * nbytes / device.link_bandwidth + device.link_latency


def experts_touched(model: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    """Expected experts a layer reads for `tokens` tokens under uniform routing: E (1 - (1 - k/E)^tokens)."""
    if not model.is_moe:
        return np.zeros_like(tokens, dtype=float)
    e, k = model.n_experts, model.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** tokens)


def _attention_peak(device: DeviceSpec, profile: Profile, w: WeightTerms) -> float:
    """FLOP/s of attention maths: 16-bit units whatever the weights are stored in."""
    return device.peak_flops.get("bf16", w.peak) * profile.compute_eff("float")


def refill_time(model: ModelSpec, profile: Profile, layer_bytes: np.ndarray) -> np.ndarray:
    """Time the step's many small operations lose re-fetching their working set, which each layer's
    stream of `layer_bytes` (its weights and its 16-bit keys and values) evicts from the core's cache:
    L x refill x min(1, layer_bytes / refill_bytes), or L x the profile's measured refill curve
    (`Profile.cache_refill_curve`, interpolated linearly from 0 at 0 bytes, flat beyond its last point)
    where it has one.  Zero where the profile does not measure it."""
    x = np.asarray(layer_bytes, dtype=float)
    if profile.cache_refill_curve:
        xs = [0.0] + [float(pt[0]) for pt in profile.cache_refill_curve]
        ys = [0.0] + [float(pt[1]) for pt in profile.cache_refill_curve]
        return model.n_layers * np.interp(x, xs, ys)
    if profile.cache_refill_s == 0 or profile.cache_refill_bytes <= 0:
        return np.zeros_like(np.asarray(layer_bytes, dtype=float))
    return model.n_layers * profile.cache_refill_s * np.minimum(1.0, layer_bytes / profile.cache_refill_bytes)


def attention_layer_bytes(model: ModelSpec, tokens: np.ndarray, devices: int = 1) -> np.ndarray:
    """16-bit keys and values one layer's attention reads for `tokens` cached tokens (whatever the cache
    stores, the attention kernel reads them dequantised)."""
    return tokens * 2 * math.ceil(model.n_kv_heads / devices) * model.head_dim * ACT_BYTES


def _overhead(model: ModelSpec, profile: Profile, w: WeightTerms, kv: KVTerms, b: np.ndarray,
              touched: np.ndarray, layer_bytes: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Fixed costs of a step whose cache holds `tokens` tokens per sequence, and the work between its matmuls at
    the model's widths (`Profile.width_overhead_s`: per layer and element of hidden + intermediate width)."""
    calls = w.linear_calls + model.n_layers * touched * w.expert_linears
    holds_quantized = quantized_tokens(tokens, np.asarray(kv.residual), np.asarray(kv.block)) > 0
    width = model.n_layers * (model.hidden_size + model.intermediate_size)
    t = (profile.overhead_s + profile.overhead_per_seq_s * (b - 1)
         + width * (profile.width_overhead_s + profile.width_overhead_per_seq_s * (b - 1))
         + calls * (w.call_overhead_s + w.call_per_seq_s * (b - 1)) + w.head_call_s
         + model.n_layers * (kv.layer_overhead_s + np.where(holds_quantized, kv.quantized_overhead_s, 0.0))
         + refill_time(model, profile, layer_bytes))
    return np.maximum(t, 0.0)


def _phases(device: DeviceSpec, profile: Profile, w: WeightTerms, kv: KVTerms, weight_q: np.ndarray,
            dense: np.ndarray, kv_q: np.ndarray, kv_w: np.ndarray, lin_flops: np.ndarray, att_flops: np.ndarray,
            att_timed: bool = False, kv_scale: np.ndarray | float = 1.0) -> dict[str, np.ndarray]:
    """The two rooflines of a step (linear layers, attention) and their sum.  The cache's quantised
    bytes (kv_q) stream at the format's efficiency, its 16-bit window (kv_w) at the 16-bit cache's, at
    `Profile.bandwidth_at` the step's whole working set (all it reads: faster than memory where it fits the
    last-level cache; `device.bandwidth` without a measured curve); the weights at the bandwidth of their own
    working set, the cache's stream not counted against them.  Measured so: charging the weights at the whole
    step's rate made a large cache slow the linears too (SmolLM2 int4-g64, 2048 tokens: its 113 MB of weights
    from 47 to 34 GB/s at batch 1, to 29 at batch 8, +1.7-1.8 ms a step), where the bench's steps grew by the
    cache's time alone; over seven probe/bench pairs (86 rows, with `width_overhead_s`), 66 rows within 10%
    against 57.  `att_timed`: those efficiencies
    are the attention's own timed rates (compute included), so its time is its bytes' alone.  `kv_scale`: x the
    cache's time per byte at the step's batch (`Profile.kv_batch_scale`)."""
    beta = profile.bandwidth_at(device, weight_q + dense + w.head_q + kv_q + kv_w)
    beta_w = profile.bandwidth_at(device, weight_q + dense + w.head_q)
    t_mem_kv = (kv_q / kv.eta + kv_w / kv.window_eta) / beta * kv_scale
    t_comp_kv = att_flops / _attention_peak(device, profile, w)
    t_att = t_mem_kv if att_timed else np.maximum(t_mem_kv, t_comp_kv)
    # compute-bound: the phases limited by compute take most of the step
    att_compute = np.logical_and(t_comp_kv > t_mem_kv, not att_timed)
    # where the 16-bit head has its own compute efficiency (eta_ch > 0), its roofline apart from the other
    # linears'; else one roofline over all (terms broadcast, so both are computed and one chosen per element)
    own = np.logical_and(np.asarray(w.eta_ch) > 0, np.asarray(w.head_flops) > 0)
    t_mem_q, t_mem_f = (weight_q / w.eta_w + w.head_q / w.eta_h) / beta_w, dense / w.eta_f / beta_w
    t_mem_w = np.where(own, t_mem_q + t_mem_f, (weight_q / w.eta_w + dense / w.eta_f + w.head_q / w.eta_h) / beta_w)
    head_flops = np.where(own, lin_flops * (w.head_flops / np.maximum(w.linear_flops, 1.0)), 0.0)
    t_comp_q = (lin_flops - head_flops) / (w.peak * w.eta_c)
    t_comp_f = head_flops / (device.peak_flops.get("bf16", w.peak) * np.where(own, w.eta_ch, 1.0))
    t_comp_w = np.where(own, t_comp_q + t_comp_f, lin_flops / (w.peak * w.eta_c))
    t_lin = np.where(own, np.maximum(t_mem_q, t_comp_q) + np.maximum(t_mem_f, t_comp_f),
                     np.maximum(t_mem_w, t_comp_w))
    split = np.where(t_comp_q > t_mem_q, t_comp_q, 0.0) + np.where(t_comp_f > t_mem_f, t_comp_f, 0.0)
    lin_compute = np.where(own, split, np.where(t_comp_w > t_mem_w, t_lin, 0.0))
    in_compute = lin_compute + np.where(att_compute, t_att, 0.0)
    return {"t_memory": t_mem_w + t_mem_kv, "t_compute": t_comp_w + t_comp_kv, "t_linear": t_lin,
            "t_attention": t_att, "compute_bound": in_compute > 0.5 * (t_lin + t_att), "bandwidth": beta,
            "weights_bandwidth": beta_w}


def decode(model: ModelSpec, device: DeviceSpec, profile: Profile, w: WeightTerms, kv: KVTerms,
           batch: np.ndarray | int, context: np.ndarray | int, devices: int = 1) -> dict[str, np.ndarray]:
    """One decode step: b sequences, each with `context` cached tokens (arrays broadcast)."""
    b = np.asarray(batch, dtype=float)
    ctx = np.asarray(context, dtype=float)
    c = b * ctx  # total cached tokens in the batch
    touched = experts_touched(model, b)
    weight_q = w.dense_q + model.n_layers * touched * w.expert_layer
    emb = b * w.emb_row
    kb = kv_step_bytes(kv, b, ctx)
    read_q, read_w, write_q, write_w = kb["read_q"], kb["read_w"], kb["write_q"], kb["write_w"]
    kv_read, kv_write = read_q + read_w, write_q + write_w
    weight_bytes = weight_q + w.dense_f + w.head_q + emb
    lin_flops = b * w.linear_flops
    att_flops = model.attention_flops_per_pair * (c + b) / devices
    ph = _phases(device, profile, w, kv, weight_q, w.dense_f + emb, read_q + write_q, read_w + write_w,
                 lin_flops, att_flops, att_timed=profile.kv_compute_measured, kv_scale=profile.kv_batch_scale(b))
    t_comm = 2 * model.n_layers * _allreduce(device, devices, b * model.hidden_size * ACT_BYTES)
    layer_bytes = weight_q / model.n_layers + attention_layer_bytes(model, c + b, devices)
    t0 = _overhead(model, profile, w, kv, b, touched, layer_bytes, ctx + 1)
    time, host_bound = _combine(profile, ph["t_linear"] + ph["t_attention"] + t_comm, t0)
    return {"weight_bytes": weight_bytes, "kv_read_bytes": kv_read, "kv_write_bytes": kv_write,
            "kv_bytes": kv_read + kv_write, "bytes": weight_bytes + kv_read + kv_write,
            "flops": lin_flops + att_flops, **ph, "t_comm": t_comm, "t_overhead": t0, "time": time,
            "host_bound": host_bound, "tokens_per_s": b / time}


def _combine(profile: Profile, t_device: np.ndarray, t_host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step time, whether the host's share sets it).  Where the host only queues the work
    (`Profile.host_overlap`: a GPU), launching and computing overlap and the slower of the two sets the
    step; where the host does the work itself (a CPU), the overheads add to it."""
    if profile.host_overlap:
        return np.maximum(t_device, t_host), t_host > t_device
    return t_device + t_host, np.zeros(np.shape(t_device + t_host), dtype=bool)


def prefill(model: ModelSpec, device: DeviceSpec, profile: Profile, w: WeightTerms, kv: KVTerms,
            batch: np.ndarray | int, prompt: np.ndarray | int, devices: int = 1) -> dict[str, np.ndarray]:
    """Prefill of `batch` prompts of `prompt` tokens (time to first token when batch is 1).

    Causal attention does p (p + 1) / 2 query-key pairs per prompt.  Usually compute-bound, so W8A8
    formats (fp8/int8 maths) shorten it where the device has the units and weight-only formats do not."""
    b = np.asarray(batch, dtype=float)
    p = np.asarray(prompt, dtype=float)
    tokens = b * p
    touched = experts_touched(model, tokens)
    weight_q = w.dense_q + model.n_layers * touched * w.expert_layer
    emb = tokens * w.emb_row
    kv_q, kv_w = kv_cache_bytes(kv, p)
    kv_q, kv_w = b * kv_q, b * kv_w
    kv_write = kv_q + kv_w
    lin_flops = tokens * w.linear_flops
    att_flops = model.attention_flops_per_pair * b * p * (p + 1) / 2 / devices
    ph = _phases(device, profile, w, kv, weight_q, w.dense_f + emb, kv_q, kv_w, lin_flops, att_flops)
    t_comm = 2 * model.n_layers * _allreduce(device, devices, tokens * model.hidden_size * ACT_BYTES)
    layer_bytes = weight_q / model.n_layers + attention_layer_bytes(model, tokens, devices)
    t0 = _overhead(model, profile, w, kv, b, touched, layer_bytes, p)
    time, host_bound = _combine(profile, ph["t_linear"] + ph["t_attention"] + t_comm, t0)
    return {"bytes": weight_q + w.dense_f + w.head_q + emb + kv_write, "flops": lin_flops + att_flops, **ph,
            "t_comm": t_comm, "t_overhead": t0, "time": time, "host_bound": host_bound}


def memory(device: DeviceSpec, profile: Profile, w: WeightTerms, kv: KVTerms,
           batch: np.ndarray | int, context: np.ndarray | int) -> dict[str, np.ndarray]:
    """Per-device memory: weights + b x (the cache of `context` tokens) against (1 - headroom) x memory.

    max_batch is for the given context, max_context for the given batch (0 when even the weights
    do not fit; with a 16-bit window it is a lower bound that assumes the fullest window, R + G - 1)."""
    b = np.asarray(batch, dtype=float)
    ctx = np.asarray(context, dtype=float)
    tq = quantized_tokens(ctx, np.asarray(kv.residual), np.asarray(kv.block))
    per_seq = tq * kv.per_token + (ctx - tq) * kv.window_per_token
    kv_bytes = (b * tq) * kv.per_token + (b * (ctx - tq)) * kv.window_per_token
    usable = device.memory_bytes * (1 - profile.memory_headroom)
    free = np.maximum(usable - w.stored, 0.0)
    weights = w.stored + np.zeros_like(kv_bytes)
    window_extra = (np.asarray(kv.residual) + np.asarray(kv.block) - 1) * np.maximum(
        kv.window_per_token - kv.per_token, 0.0)
    return {"weights": weights, "kv": kv_bytes, "need": weights + kv_bytes,
            "usable": usable, "headroom": device.memory_bytes * profile.memory_headroom,
            "fits": w.stored + kv_bytes <= usable,
            "max_batch": np.floor(free / per_seq),
            "max_context": np.maximum(np.floor((free - b * window_extra) / (b * kv.per_token)), 0.0)}
