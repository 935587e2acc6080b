"""`fewbits probe`: measure this machine and write a device profile the cost model loads.

What is measured (the fastest of interleaved samples, see `timing.py`):

1. memory bandwidth: a read-only reduction over a buffer larger than the last-level cache
   (best of several trials, the roofline's beta), and over working sets of 32-512 MiB (`bandwidth_curve`:
   a step whose weights fit the last-level cache re-reads them from there, here 53 GB/s at 64 MiB against
   25 GB/s from memory; each set's fastest of 60 passes, as the cache takes a set over tens of them); memory is
   read again at the probe's end, and a host whose load moved between the two reads is named (`drift_line`);
2. matmul rate per precision: a square GEMM in fp32, bf16, fp16 and int8 (``torch._int_mm``);
3. GEMV per weight format at the model's decode shapes: every linear layer of the model, then the LM head
   (in bf16 as fewbits keeps it, timed apart), once per sample over one copy of the model's weights as the
   step re-reads them (`gemv_passes`), through the kernel dispatcher (on the compiled path as its step calls
   them: q/k/v and gate/up fused where `fewbits.decode.fuse` fuses them, each sample's calls made from one
   compiled graph, `gemv.compiled_calls`), at 1 and at 8 rows ((rows, 1, in)
   inputs, as the model passes them; the fastest of samples that each cover a whole step's linears, over
   `PASS_SWEEPS` sweeps, before and after the skeleton's steps of 4.), and the same calls on a
   tiny shape.  Bandwidth efficiency of a family = bytes / (time - time of the tiny calls) /
   beta at the pass's working set (the 16-bit LM head every format keeps at its own: head bytes / head time /
   beta); where 8 rows take longer than 1 row
   the pass is compute-limited, and compute efficiency = FLOPs / (time x peak).  On a CPU the integer formats
   are also timed on the kernels that round the activations to int8 (``int4-g64+a8``: `prepare_linear_q8`,
   what `fewbits bench --activations q8` runs), where they differ from the weight-only ones: their figures are
   the "+a8" families of the profile (`fewbits.cost.profile`).  A quantised family's cost
   per linear call is its tiny calls' time less the time the skeleton step (4.) spends in its own 16-bit
   linears (measured by replacing them with zero outputs: ~20 us a call in a step here, against ~4 us in a
   pass of tiny 16-bit calls), which a model whose linears run a quantised kernel never pays; and every family's
   tiny calls' growth from 1 to 8 rows is its cost per call and extra sequence (`probe_calls.call_growth`: the
   kernels' own work on x, which neither the bytes nor the skeleton's fit charge);
4. decode steps of a skeleton model (the model's heads, head size and vocabulary, 16-wide linears) per
   KV format, at batch 1 and 8 and contexts of 128, 512 and 2048 tokens, through the same decode loop and cache
   as `fewbits bench`.  One least-squares fit over all formats (see `step_costs`; every cost held >= 0,
   `fewbits.bench.stepfit.bounded_lstsq`) gives the fixed cost per step (a
   of the 16-bit cache), the cost per extra sequence (p), the KV read efficiency per format (1 / (s
   beta); cache bytes are the store's true bytes, a KIVI cache's 16-bit window, which the store copies
   every step, at its own rate) and the extra fixed cost of each quantised cache per layer (a KIVI
   cache's dequantisation only once its window has overflowed).  On the eager path the skeleton has
   the model's depth.  On the compiled path (the default) every (KV format, batch, cache length) is a
   graph to compile, minutes each at the model's depth: the skeletons there are 2 and 6 layers deep
   (`COMPILED_DEPTHS`; the 16-bit cache at both, to split the fixed costs into a part per step and a
   part per layer, which the fit scales to the model's depth), and a cache without a window runs only
   the largest context at each batch (the 16-bit cache at 2 layers the shortest too): 26 shallow graphs,
   each saved on disk (`fewbits.decode.precompiled`), so that a second probe loads them.  Before each
   timed step the skeleton's KV cache is evicted from the CPU's caches (`fewbits.bench.evict`), so that it
   comes from memory as a model's step, whose weights and other layers pass between, reads it; the cache's
   efficiency is then relative to the memory's bandwidth, and the step model scales it by the bandwidth at
   the step's working set;
5. the core-cache refill: the same skeleton at batch 1 with every layer first streaming twice an L2
   cache's worth of bytes of its own; the time the step's small operations lose (the streaming itself
   subtracted) per layer is what a real model's weights, or a large batch's cache, cost them; measured
   at streams of 0.5-8 L2 sizes, the refill curve the cost model interpolates (it is not a ramp that
   stops at the L2 size: eager, here 1 MiB 0.14 ms, 2 MiB 0.23, 4 MiB 0.26, 8 MiB 0.32 per layer).  It is
   why a batch-1 step seems to pay more per cached byte than a batch-8 one: a small batch's cache
   evicts a growing part of the L2 cache the small operations run from, a large batch's all of it.  The
   compiled path measures its own, far smaller refill (`fewbits.bench.refill.CompiledRefill`: a 16-bit
   matmul of x bytes before each layer's norm, inside compiled skeletons at the model's depth);
6. (compiled path, CPU) the step's work between its matmuls at the model's widths (norms, residual adds, the
   MLP's gate product: `fewbits.bench.probe_calls.width_cost`), which the 16-wide skeleton does on 16-wide
   rows: two models of the model's depth whose every linear is an opaque stand-in that costs almost nothing,
   one at the model's widths and one at the skeleton's; their steps' difference per layer, width element and
   row of the batch (`width_fields`; SmolLM2: 0.79-0.94 ms a step at batch 8, where the steps of its int4 and
   int8 models take 8-12 ms).

On a CUDA device (``device="cuda"``) the same measurements run there, each sample ending with a device
synchronisation: the bandwidth over a buffer many times the GPU's L2 cache, the GEMMs at 8192 (and FP8
through ``torch._scaled_mm`` where the chip has it), the GEMV passes through the dispatcher's CUDA kernels,
and the skeleton's steps, whose fixed cost there is mostly the host launching kernels.  Step 5 is a CPU
effect (small operations losing their core cache) and is not measured on a GPU.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch

from fewbits.bench.evict import cache_evictor
from fewbits.bench.gemv import A8, build_set, inputs_for
from fewbits.bench.machine import (
    CURVE_SIZES,
    bandwidth_curve,
    device_description,
    l2_cache_bytes,
    matmul_rates,
    matmul_size,
    memory_bandwidth,
)
from fewbits.bench.probe_calls import (
    call_growth,
    fastest_of_sweeps,
    linear_efficiencies,
    skeleton_linear_cost,
    skeleton_rows_cost,
    take_off_rows,
    width_cost,
)
from fewbits.bench.refill import CompiledRefill, refill_cost, refill_curve
from fewbits.bench.stepfit import fit_step_costs, step_profile_fields
from fewbits.bench.timing import time_interleaved
from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import DEFAULT, Profile, curve_bandwidth
from fewbits.decode import pages
from fewbits.formats.format import parse_format
from fewbits.generate import synchronizer
from fewbits.kvcache.format import parse_kv_format
from fewbits.models.spec import ModelSpec

WEIGHT_SPECS = ("bf16", "int8", "int4-g64", "fp8-e4m3")
KV_SPECS = ("bf16", "fp8-e4m3", "int8", "int4", "int2")
#: cache lengths of the skeleton's steps.  A windowed (KIVI) cache's step is not linear in its bytes from one to the
#: next: at 128 tokens it is all 16-bit window, at 512 the quantised part is 384 tokens whose cost a second operator
#: pass's fixed cost hides; fitted on 128 and 512 alone, a probe charged KIVI int4 211 ms per GB of cache where its
#: steps from 512 to 2048 tokens took ~120, and predicted SmolLM2's 2048-token step +60% (6-layer skeleton: +43% at
#: batch 8, with 2048 in the fit +1%).  Formats without a window run only the longest (fixed + per-byte cost).
KV_CONTEXTS = (128, 512, 2048)
#: stream sizes (x the L2 size) at which the probe measures the refill curve (eager path; the compiled path, two
#: graphs of the model's depth per size, at fewer)
REFILL_SIZES = (0.5, 1.0, 2.0, 4.0, 8.0)
COMPILED_REFILL_SIZES = (1.0, 2.0, 4.0)
#: sweeps of the GEMV passes (3.), one before the skeleton's steps (4.) and the rest after them (tens of seconds
#: apart where the skeletons' graphs are on disk, minutes where they compile): each pass keeps its fastest sweep
#: (`probe_calls.fastest_of_sweeps`), as a step keeps its fastest sample
PASS_SWEEPS = 2
#: samples of each GEMV pass (3.), one after the other: a model's weights that fit the last-level cache are taken
#: by it over tens of passes (`fewbits.bench.machine.CURVE_PASSES`), as a decode's steps take them; SmolLM2's int8
#: linears (106 MB) ran their pass in 5.5 ms at first and 3.0-3.3 ms from the 50th (a 2-core Emerald Rapids Xeon,
#: session 47), where 30 samples had kept 3.85 ms.  A pass of a model this small is milliseconds: 80 cost ~1 s
PASS_ROUNDS = 80


#: how far the memory read at the probe's end may lie from the one at its start before the probe says the host moved
DRIFT = 0.10


def drift_line(start: float, end: float) -> str:
    """The probe's last line about the host: memory read at its end against its start, and a warning where they
    differ by more than `DRIFT` (a shared host's load moves within minutes: one probe here read 22.1 GB/s where
    the others read 27.6-29.8, ran the int4-g64 8-row pass at twice their time, and predicted its benches up to
    50% slow; its figures then describe a machine the bench does not find)."""
    ratio = end / start
    return (f"memory read at the end: {end / 1e9:.1f} GB/s, {ratio:.2f}x the start's {start / 1e9:.1f} GB/s"
            + ("" if abs(ratio - 1) <= DRIFT else
               " (the host moved during the probe, e.g. other processes' load: its figures mix two machines; "
               "probe again at a quieter moment)"))


def sixteen_bit_peaks(rates: dict[str, float], device: str | torch.device) -> dict[str, float]:
    """The matmul rates the cost model uses as peaks: on a CPU, bf16 and fp16 at least the fp32 rate.  fewbits'
    CPU decode kernels (`fewbits.kernels.rows`, `cpu_int4`) widen 16-bit and integer weights to fp32 where the
    CPU has no 16-bit multiply units, and torch's own 16-bit GEMM there can run far below fp32 (1 GFLOP/s
    against 63 on an AVX2 EPYC), which would make every predicted decode step compute-bound."""
    if torch.device(device).type != "cpu" or "fp32" not in rates:
        return dict(rates)
    return {k: max(v, rates["fp32"]) if k in ("bf16", "fp16") else v for k, v in rates.items()}


def layer_shapes(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(out, in) of the linears of one decoder layer (dense models; experts of MoE models are not timed)."""
    shapes = []
    for s in spec.linear_shapes():
        if s.role in ("attention", "mlp"):
            shapes += [s.shape] * (s.count // spec.n_layers)
    return tuple(shapes)


def head_shape(spec: ModelSpec) -> tuple[int, int]:
    return next(s.shape for s in spec.linear_shapes() if s.role == "lm_head")


TINY = (16, 64)  # a shape every CPU kernel accepts: the per-call cost of a kernel without the bytes


def step_inputs(shapes: tuple[tuple[int, int], ...], rows: int, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> dict[int, torch.Tensor]:
    """Inputs as a decode step hands them to its linears: (batch, 1 new token, in_features) hidden states."""
    return {k: x.reshape(rows, 1, k) for k, x in inputs_for(shapes, rows, dtype, device=device).items()}


def named_layer_shapes(spec: ModelSpec) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(name, (out, in)) of the linears of one decoder layer, as `layer_shapes`."""
    out = []
    for s in spec.linear_shapes():
        if s.role in ("attention", "mlp"):
            out += [(s.name, s.shape)] * (s.count // spec.n_layers)
    return tuple(out)


def gemv_passes(spec: ModelSpec, formats: tuple[str, ...], min_bytes: int | None = None, rows: tuple[int, ...] = (1, 8),
                rounds: int = PASS_ROUNDS, device: str | torch.device = "cpu", fused: bool = False,
                graphs: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Per format: time of the linears of one decode step (n_layers x one layer's calls) at 1 and 8 rows,
    with the per-call cost (the same number of calls on a tiny shape) measured separately.

    Measured the way the step runs them, so that the figure is the one `fewbits bench` reports: each
    sample is a whole step's linears (the next copies, cold) and the fastest sample counts (the bench keeps
    its fastest step; the sum over layers of each layer's fastest sample is lower, by 8-20% here: a step
    never finds all its layers at their quietest), and the inputs are (rows, 1, in) as in the model (a 16-bit
    linear on a 3-d input costs ~5-7 us more per call than on a 2-d one here).

    Each sample runs a whole step's weights as the step does: every layer's linears, then the 16-bit LM head
    (timed apart), over one copy of the model (`min_bytes` None: the step's own footprint, read again at the
    next step as a decode re-reads its weights; a model that fits the last-level cache is read from there:
    SmolLM2 int4-g64, 2 threads, 480 MB of L3 shared with other machines, ran its kernel ~2.6 ms a step inside
    the compiled step and ~3.9 ms over a pool of 600 MB) or over copies of at least `min_bytes` bytes.  Each
    format's `pool_bytes` is that working set (linears and head): its efficiency is relative to the bandwidth
    there (`fewbits.bench.machine.bandwidth_curve`).  The first format's head timings are the 16-bit head's
    ("lm_head_bf16"; `build_profile` measures "bf16" first); every format records its own (`t_head_s`).

    `fused`: the calls of the compiled decode step (`gemv.build_step_set`): each layer built as the quantised
    model holds it, through the dispatcher, with q/k/v and gate/up fused into one matmul each where
    `fewbits.decode.fuse` fuses them (one 960 x 576 matmul reads its bytes at another rate than three
    separate ones); else every linear on its own (`gemv.build_set`, the eager path's calls).  `fused` on a CPU:
    each sample's calls (the step's linears, the head, the tiny calls) are made from one compiled graph, as the
    compiled step makes them (`gemv.compiled_calls`; `graphs`: the compiled graphs, kept by the caller for the
    next sweep), not from Python, whose interpreter between the calls a pass's tiny calls do not fully take off."""
    from fewbits.bench.gemv import build_step_set

    shapes = layer_shapes(spec)
    results: dict[str, dict[str, Any]] = {}
    sync = synchronizer(device)
    on_gpu = torch.device(device).type != "cpu"
    compiled = {} if graphs is None else graphs
    if not fused or on_gpu:
        compiled = None  # Python calls: the eager step's own way; a GPU's host queues them while the device streams
    # the pass's time counts whole (its calls' own cost included) on a GPU, whose host queues the calls while the
    # device streams, and on the compiled CPU path: there the calls (SmolLM2's 150 a step: ~0.35 ms of tiny calls,
    # 2.3 us each) cost what nothing else charges: the skeleton's fitted fixed cost that was to carry them came to
    # 0.09 ms a step, and the settled compiled step ran 0.45-1.08 ms over its pass (linears and head, one process,
    # rounds alternating) where the model charged 0.33-0.37 ms besides the bytes (a 2-core Emerald Rapids Xeon,
    # session 47: int8 at batch 1 predicted 3.79 ms for a 4.15-4.4 ms step, 4.14 ms with the calls counted).  On
    # an eager CPU step a quantised call is charged against the skeleton's own 16-bit call (`linear_efficiencies`)
    whole_pass = on_gpu or compiled is not None

    def build(f: str, pool: int) -> Any:
        return build_step_set(f, named_layer_shapes(spec), pool, device=device) if fused else \
            build_set(f, shapes, pool, device=device)

    head_set = build_step_set("bf16", (("lm_head", head_shape(spec)),), 0 if min_bytes is None else min_bytes,
                              device=device) if fused else \
        build_set("bf16", (head_shape(spec),), 0 if min_bytes is None else min_bytes, device=device)
    for f in formats:
        body = build(f, 0)  # one layer: its bytes size the pool
        pool = min_bytes if min_bytes is not None else body.nbytes * spec.n_layers
        if pool > body.nbytes:
            body = build(f, pool)
        if fused and not on_gpu:  # in huge pages, as the compiled step's decoder holds them (`fewbits.decode.pages`)
            pages.place([body, head_set])
        calls = body.shapes  # one layer's calls: fused groups count once
        per_step = len(calls) * spec.n_layers
        # the same calls on a tiny shape, made the same way (from one compiled graph where the step's are; from
        # Python through the step's path on a GPU: ~11 us a call here against ~6 us for the bare kernels, whose
        # difference had been counted as bytes)
        tiny = build_step_set(f, tuple((n, TINY) for n, _ in named_layer_shapes(spec)), 0, device=device) \
            if fused else build_set(f, (TINY,) * len(calls), 0, device=device)
        res: dict[str, Any] = {"kernels": list(body.kernel_names), "bytes": body.nbytes * spec.n_layers,
                               "calls": per_step, "whole_pass": whole_pass,
                               "pool_bytes": body.nbytes * body.copies + head_set.nbytes * head_set.copies}
        for m in rows:
            xs = step_inputs(tuple(calls) + (TINY,), m, torch.float32 if f == "fp32" else torch.bfloat16, device)
            hx = step_inputs((head_shape(spec),), m, device=device)
            linears, head = body.sampler(xs, per_step, compiled), head_set.sampler(hx, 1, compiled)
            parts: dict[str, list[float]] = {"body": [], "head": []}

            def step(linears: Any = linears, head: Any = head, parts: dict[str, list[float]] = parts) -> None:
                t0 = time.perf_counter()
                linears()
                sync()
                t1 = time.perf_counter()
                head()
                sync()
                parts["body"].append(t1 - t0)
                parts["head"].append(time.perf_counter() - t1)

            # one sample = the linears of one step and the head, or the same linears' calls on tiny shapes
            t = time_interleaved({"body": step, "tiny": tiny.sampler(xs, per_step, compiled)}, min_time=0.0,
                                 rounds=rounds, sync=sync)
            t_body, t_head = min(parts["body"]), min(parts["head"])
            t_calls = t["tiny"]
            # the bytes' share of the pass: on an eager CPU step the calls' own cost adds to it (charged per call
            # against the skeleton's 16-bit calls); on a GPU the host launches the next calls while the device
            # streams, so the whole pass is the device's (host_overlap); on a compiled CPU step the calls cost what
            # nothing else charges, so the whole pass too (`whole_pass`)
            t_bytes = t_body if whole_pass else max(t_body - t_calls, 1e-9)
            res[f"rows{m}"] = {"t_s": t_body, "t_calls_s": t_calls, "t_bytes_s": t_bytes, "t_head_s": t_head,
                               "flops": 2 * m * sum(a * b for a, b in shapes) * spec.n_layers}
        results[f] = res
        if "lm_head_bf16" not in results:
            results["lm_head_bf16"] = {"bytes": head_set.nbytes, "pool_bytes": res["pool_bytes"],
                                       **{f"rows{m}": {"t_s": res[f"rows{m}"]["t_head_s"]} for m in rows}}
        del body, tiny  # free the copies before the next format's (a GPU holds one format's at a time)
    return results


def skeleton_widths(spec: ModelSpec) -> tuple[int, int]:
    """(hidden, intermediate) of `skeleton_model`: ~16, a multiple of the head count (as transformers wants)."""
    return spec.n_heads * -(-16 // spec.n_heads), 16


def llama_config(spec: ModelSpec, hidden: int, intermediate: int, depth: int, tie: bool) -> Any:
    """A transformers `LlamaConfig` with `spec`'s heads, KV heads, head size and vocabulary and the given widths,
    depth and head tying (the probe's stand-in models of a decode step)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=depth, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
                       head_dim=spec.head_dim, max_position_embeddings=max(4096, spec.max_position_embeddings),
                       tie_word_embeddings=tie)


def skeleton_model(spec: ModelSpec, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A Llama model with `spec`'s depth, heads, KV heads, head size and vocabulary but ~16-wide hidden
    states (a multiple of the head count) and MLPs: a decode step of it costs what the weight bytes do not
    (framework dispatch, norms, rotary, attention over the cache, the cache's own writes and reads,
    sampling over the vocabulary)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(spec, *skeleton_widths(spec), spec.n_layers, tie=True)
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's global generator
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


#: skeleton depths of the compiled path's steps: every KV format at the last, the 16-bit cache at each (the fit
#: splits the fixed cost into a part per step and a part per layer, and scales it to the model's depth)
COMPILED_DEPTHS = (2, 6)


def step_costs(spec: ModelSpec, kv_specs: tuple[str, ...], contexts: tuple[int, ...] = KV_CONTEXTS,
               batches: tuple[int, int] = (1, 8), steps: int = 8, rounds: int = 3,
               refill_bytes: int | None = None, measure_refill: bool = True,
               refill_sizes: tuple[float, ...] | None = None, device: str | torch.device = "cpu",
               compiled: bool = False, depths: tuple[int, ...] | None = None,
               evict: bool = True, log: Any = None) -> dict[str, dict[str, Any]]:
    """Per KV format: decode steps of `skeleton_model` at two batches and several contexts (the fastest of
    `steps` steps in each of `rounds` interleaved rounds), fitted jointly by least squares with

        t = a0 + a1 L + o_f L [holds quantised tokens] + x_f L + (p0 + p1 L) (b - 1) + s_f q + w_f w + E(x) L

    L: the skeleton's depth; q, w: the quantised and the 16-bit (window) cache bytes of the step at that
    depth as the cost model counts them (`kv_step_bytes`, the store's true bytes; a 16-bit cache's bytes
    all count as q, at s_16); a0 + a1 L: the 16-bit cache's fixed time per step; x_f: more per layer for
    format f; o_f: more per layer once a windowed (KIVI) cache holds quantised tokens and dequantises them;
    p0 + p1 L: time per sequence beyond the first; s_f, w_f: seconds per quantised and per window byte (the
    store copies the window every step); E: the time per layer the step's small operations lose when a
    layer's stream of x bytes of 16-bit keys and values (`attention_layer_bytes`) evicts their working set
    from a core cache of X bytes (`l2_cache_bytes`; `refill_bytes` overrides it, 0 leaves E out), E min(1,
    x / X).  E is measured directly (eager `refill_cost`, compiled `CompiledRefill`: every layer streams
    2 X bytes of its own) and the fit is over t - E L min(1, x / X); with `measure_refill` False it is fitted
    with the rest (a fitted E < 0 is refitted as 0).  The refill is also measured at streams of
    `refill_sizes` x X bytes (default `REFILL_SIZES` eager, `COMPILED_REFILL_SIZES` compiled: the refill
    curve E(x) the cost model interpolates; the fit then subtracts L E(x) instead).  On a device other
    than the CPU the refill is a core-cache effect that does not apply: E is left out.

    `depths`: the skeleton depths measured (default: the model's own on the eager path, `COMPILED_DEPTHS`
    on the compiled one): every KV format at the last, the first KV format (the 16-bit cache) at every one.
    With one depth the fixed costs cannot be split and a1 = p1 = 0 (exact when that depth is the model's).
    The figures returned are for the model's own depth (`spec.n_layers`).

    `compiled`: the steps run on the compiled static-cache path (`fewbits.decode`, what `fewbits bench` runs
    by default), so the fixed costs are that path's (one graph, no Python per layer).  Each (KV format,
    batch, cache length, depth) is one graph, compiled once (or loaded from the on-disk cache, where the
    same skeleton was compiled before) before its timed steps; a shallow skeleton compiles in a fraction of
    the model's depth's time, the reason for the depths.  The refill is measured on the compiled path too
    (`CompiledRefill`, one graph per stream size at the model's depth; eager: `refill_cost`'s hooks).

    `evict` (compiled path, CPU): before each timed step the skeleton's KV cache is evicted from the CPU's
    caches, outside the step's time (`fewbits.bench.evict`): a real step reads a layer's cache again only after
    its weights and its other layers' caches have passed, so from memory where those exceed the last-level
    cache, while a skeleton stepped alone finds its shallower cache there (SmolLM2's attention at 2048 tokens,
    batch 8, 16-bit cache: 20.5 GB/s over 6 layers' caches, 11.9 over 30).  The figures returned say whether
    it ran (``cache_evicted``): the cache's efficiency is then relative to the memory's bandwidth.

    Before the fit, each step time loses what the skeleton's own linears (its vocabulary-wide LM head, each
    layer's 16-wide projections) take at its batch beyond the cost of their calls (`skeleton_rows_cost`,
    `take_off_rows`): the GEMV passes charge the model's own linears' work at every batch, so the fit's
    terms are the rest of the step's cost.  The amounts are kept with each format's figures
    (``skeleton_rows_s``)."""
    import dataclasses

    from fewbits.generate import generate

    decode = generate
    if compiled:
        from fewbits.decode.generate import generate_static as decode
    depths = tuple(depths or ((spec.n_layers,) if not compiled else COMPILED_DEPTHS))
    say = log or (lambda _m: None)
    specs = {d: dataclasses.replace(spec, n_layers=d) if d != spec.n_layers else spec for d in depths}
    models = {d: skeleton_model(specs[d], device) for d in depths}
    main = depths[-1]
    g = torch.Generator().manual_seed(0)
    fastest: dict[tuple[str, int, int, int], float] = {}
    on_cpu = torch.device(device).type == "cpu"
    x_cache = 0 if not on_cpu else l2_cache_bytes() if refill_bytes is None else refill_bytes
    if refill_sizes is None:
        refill_sizes = COMPILED_REFILL_SIZES if compiled else REFILL_SIZES
    rests: dict[float, dict[bool, float]] = {f: {} for f in (2.0, *refill_sizes)}
    refill = None
    curve: list[tuple[float, float]] = []
    runs = [(s, d) for s in kv_specs for d in depths if d == main or s == kv_specs[0]]

    def shapes(s: str, d: int) -> list[tuple[int, int]]:
        """The (batch, context) points of format `s` at depth `d`: every one where the fit needs them (the 16-bit
        cache at the main depth: the per-sequence and per-byte costs; a windowed cache: its window and its
        dequantisation), else the largest context at each batch (a fixed and a per-byte cost to tell apart), and
        for the 16-bit cache at another depth the shortest too: its fixed cost per layer from steps whose cache
        is small as well, not only from the longest, where it takes up whatever a batch-1 cache read from memory
        costs beyond the per-byte rate the batch-8 steps fit."""
        if not compiled or (d == main and (s == kv_specs[0] or parse_kv_format(s).residual > 0)):
            return [(b, c) for b in batches for c in contexts]
        ends = (min(contexts), max(contexts)) if s == kv_specs[0] else (max(contexts),)
        return [(b, c) for b in batches for c in dict.fromkeys(ends)]
    evicted = True
    refill_model: torch.nn.Module | None = None
    compiled_refill = None
    if measure_refill and x_cache > 0:
        if compiled:  # the refill of the compiled step: its own skeletons with streams, at the model's depth
            t0 = time.perf_counter()
            compiled_refill = CompiledRefill(lambda: skeleton_model(spec, device),
                                             {f: int(f * x_cache) for f in rests}, spec.vocab_size, spec.hidden_size,
                                             steps=steps)
            say(f"  refill: {len(rests)} {spec.n_layers}-layer skeletons streaming {min(rests):g}-{max(rests):g} "
                f"L2 sizes a layer: {time.perf_counter() - t0:.0f} s (compiling included)")
        else:
            refill_model = models.get(spec.n_layers) or skeleton_model(spec, device)
    for r in range(rounds):
        # streams of twice the L2 size: past the knee, where a real model's layer weights (2-7 MB for SmolLM2)
        # and a large batch's cache lie (the loss keeps growing slowly beyond X: a stream of X alone undercounts)
        if compiled_refill is not None:
            compiled_refill.measure(rests)
        elif refill_model is not None:
            for f in rests:  # E(x): the loss grows ~linearly to about 2 X here, then slowly (1.8 MB <-> 7 MB: 2x)
                refill_cost(refill_model, spec, int(f * x_cache), steps=steps, rounds=1, best=rests[f])
        if measure_refill and x_cache > 0:
            refill = max((rests[2.0][True] - rests[2.0][False]) / spec.n_layers, 0.0)
            curve = refill_curve(x_cache, rests, spec.n_layers)
        for s, d in runs:
            kvf = parse_kv_format(s)
            model = models[d]
            if not compiled:  # (a compiled step is run once when it is compiled)
                generate(model, torch.randint(0, spec.vocab_size, (1, 16), generator=g), 3, kv=kvf)  # warm up
            t0 = time.perf_counter()
            for b, c in shapes(s, d):  # (on the compiled path each is one graph: the fewer, the faster)
                ids = torch.randint(0, spec.vocab_size, (b, c), generator=g)
                between = cache_evictor(model, kvf, b, c + steps + 1) if compiled and evict and on_cpu else None
                evicted = evicted and between is not None
                t = min(decode(model, ids, steps + 1, kv=kvf, between=between).decode_step_s)
                fastest[(s, b, c, d)] = min(t, fastest.get((s, b, c, d), t))
            if r == 0:
                say(f"  {s} cache, {d}-layer skeleton: {time.perf_counter() - t0:.0f} s (compiling included)")
    rows_cost = skeleton_rows_cost(models[main], batches, compiled=compiled)
    say("  the skeleton's own linears' work beyond their calls (taken off its steps: the GEMV passes count the "
        "model's own): " + ", ".join(f"batch {b}: head {r['head'] * 1e3:.2f} ms, a layer {r['layer'] * 1e6:.0f} us"
                                     for b, r in rows_cost.items()))
    fit = fit_step_costs(spec, kv_specs, take_off_rows(fastest, rows_cost), steps, x_cache, refill,
                         curve if len(refill_sizes) else None, measured=fastest)
    for r in fit.values():
        r["skeleton_rows_s"] = {str(b): v for b, v in rows_cost.items()}  # what was taken off, for the record
        r["cache_evicted"] = evicted
    return fit


def width_fields(width: dict[int, float]) -> dict[str, float]:
    """`Profile.width_overhead_s` and `width_overhead_per_seq_s` from `width_cost`'s {batch: seconds per layer and
    width element}: work on batch x width elements, so one rate per row, the least-squares line through the origin
    in the batch (both fields that rate; none measured: 0).  The batch-1 difference alone is at the host's noise:
    SmolLM2's 0.02-0.30 ms a step over five probes (1-3% of the step), where batch 8's was 0.79-0.94 ms."""
    if not width:
        return {"width_overhead_s": 0.0, "width_overhead_per_seq_s": 0.0}
    rate = max(sum(b * v for b, v in width.items()) / sum(b * b for b in width), 0.0)
    return {"width_overhead_s": rate, "width_overhead_per_seq_s": rate}


def build_profile(spec: ModelSpec, name: str = "this-machine", weight_specs: tuple[str, ...] = WEIGHT_SPECS,
                  kv_specs: tuple[str, ...] = KV_SPECS, min_bytes: int | None = None,
                  log: Any = print, bandwidth_bytes: int | None = None, matmul_n: int | None = None,
                  kv_contexts: tuple[int, ...] = KV_CONTEXTS, device: str | torch.device = "cpu",
                  compiled: bool = True) -> Profile:
    """Run every measurement on `device` and assemble a `Profile` carrying it as its DeviceSpec.

    bandwidth_bytes / matmul_n default to 1 GiB / 1024 on the CPU and 4 GiB / 8192 on a GPU (whose L2
    cache is tens of MB and whose GEMMs need large tiles to reach their peak).  The size arguments exist
    so that tests can run the whole probe on small buffers in seconds.  `min_bytes`: the GEMV passes' pools
    (`gemv_passes`; None: the model's own footprint per format).  `compiled`: the decode steps (4.) on
    the compiled static-cache path that `fewbits bench` runs by default (False: the eager path)."""
    t_start = time.perf_counter()
    on_cpu = torch.device(device).type == "cpu"
    bandwidth_bytes = bandwidth_bytes or (1 << 30 if on_cpu else 4 << 30)
    matmul_n = matmul_n or matmul_size(device)
    log(f"memory bandwidth ({device}) ...")
    bw = memory_bandwidth(bandwidth_bytes, device=device)
    log(f"  {bw / 1e9:.1f} GB/s")
    curve = bandwidth_curve(tuple(n for n in CURVE_SIZES if n < bandwidth_bytes), device=device,
                            memory=(bandwidth_bytes, bw))
    if len(curve) > 1:
        log("  over a working set of " + ", ".join(f"{b / 2**20:.0f} MiB {v / 1e9:.1f}" for b, v in curve) + " GB/s")
    log("matmul rates ...")
    measured_rates = matmul_rates(matmul_n, device)
    log("  " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in measured_rates.items()))
    rates = sixteen_bit_peaks(measured_rates, device)
    if rates != measured_rates:
        log(f"  16-bit weights are multiplied in fp32 here (fewbits' CPU kernels widen them): {rates['fp32'] / 1e9:.0f}"
            " GFLOP/s for bf16 and fp16")
    log(f"GEMV passes over {spec.name}'s linears{' (as the compiled step calls them)' if compiled else ''} ...")
    t_phase = time.perf_counter()
    formats = tuple(dict.fromkeys(("bf16", *weight_specs)))
    if on_cpu:  # and the integer formats' kernels that round the activations to int8 (`fewbits bench --activations q8`)
        formats += tuple(f + A8 for f in formats if parse_format(f).kind == "int")
    graphs: dict[str, Any] = {}  # the compiled passes' graphs, for the second sweep
    sweeps = [gemv_passes(spec, formats, min_bytes, device=device, fused=compiled, graphs=graphs)]
    log(f"  ({time.perf_counter() - t_phase:.0f} s)")
    t_phase = time.perf_counter()
    if compiled:
        depths = tuple(d for d in COMPILED_DEPTHS if d < spec.n_layers) or (spec.n_layers,)
        log(f"compiled decode steps of {' and '.join(map(str, depths))}-layer skeletons (16-wide linears) per KV "
            "format ...")
    else:
        depths = (spec.n_layers,)
        log(f"decode steps of a {spec.n_layers}-layer skeleton (16-wide linears) per KV format ...")
    kv = step_costs(spec, kv_specs, kv_contexts, device=device, compiled=compiled, depths=depths, log=log)
    log(f"  ({time.perf_counter() - t_phase:.0f} s)")
    width: dict[int, float] = {}
    if compiled and on_cpu:  # the work between the matmuls at the model's widths, which the 16-wide skeleton misses
        t_phase = time.perf_counter()
        log(f"the step's work besides its matmuls at {spec.name}'s widths against the skeleton's ...")
        width = width_cost(spec, device=device)
        per_step = spec.n_layers * (spec.hidden_size + spec.intermediate_size)
        log("  " + ", ".join(f"batch {b}: {v * per_step * 1e3:.2f} ms a step" for b, v in width.items())
            + f" ({time.perf_counter() - t_phase:.0f} s)")
    for _ in range(PASS_SWEEPS - 1):
        log("GEMV passes again (each keeps its fastest sweep) ...")
        t_phase = time.perf_counter()
        sweeps.append(gemv_passes(spec, formats, min_bytes, device=device, fused=compiled, graphs=graphs))
        log(f"  ({time.perf_counter() - t_phase:.0f} s)")
    passes = fastest_of_sweeps(sweeps)
    for f in [f for f in passes if f.endswith(A8)]:
        if passes[f]["kernels"] == passes[f.removesuffix(A8)]["kernels"]:
            del passes[f]  # no such kernel on this CPU: the weight-only figures stand
    # in a compiled step a quantised matmul is one call of its operator from the generated code, as the
    # skeleton's 16-bit matmul it replaces is: no Python wrapper per call left to charge (nor to measure).  On an
    # eager CPU step the skeleton's own 16-bit calls stand for the model's, and a family's extra per call is its
    # tiny calls' time over the 16-bit tiny calls', side by side in one loop: set against the skeleton's 16-bit
    # calls timed inside its steps instead (`skeleton_linear_cost`), the tight loop's quantised calls had come out
    # ~19 us a call cheaper than a 16-bit one and the eager int8 / int4-g64 SmolLM2 steps 8-35% slower than
    # predicted (a 2-core Emerald Rapids Xeon).  A GPU's eager probe keeps it (not measured again there)
    skel_lin = None if compiled or on_cpu else skeleton_linear_cost(spec, device=device)
    if skel_lin is not None:
        log(f"  the skeleton's own linears: {skel_lin * 1e3:.2f} ms a step")
    bw_eff, head_eff, comp_eff, call_extra, head_comp = linear_efficiencies(
        spec, passes, bw, rates["bf16"], log, skel_lin, bw_at=lambda n: curve_bandwidth(curve, bw, n))
    if compiled:
        call_extra = {fam: 0.0 for fam in call_extra}
    # the calls' growth per extra row where nothing else charges it: not on a GPU (its host queues the calls while
    # the device streams, host_overlap), nor on the compiled CPU path (its whole passes hold their calls' time)
    per_seq = call_growth(passes, len(layer_shapes(spec)) * spec.n_layers, log) if on_cpu and not compiled else {}
    comp_eff.setdefault("float", DEFAULT.compute_eff("float"))
    fewest = min((p["bytes"] for f, p in passes.items() if not f.startswith("lm_head")), default=0)
    head = passes.get("lm_head_bf16", {}).get("bytes", 0)  # every format's step reads the 16-bit head
    evicted = all(r.get("cache_evicted", False) for r in kv.values())  # its cache read from memory: beta
    fields = step_profile_fields(spec, kv, bw, log, bw_at=None if evicted else lambda n: curve_bandwidth(curve, bw, n),
                                 weight_bytes=fewest + head)
    bw_end = memory_bandwidth(bandwidth_bytes, device=device)
    log(drift_line(bw, bw_end))
    peak = {k: v for k, v in rates.items() if k in ("bf16", "fp16", "fp32")}
    for low in ("int8", "fp8"):  # low-precision units count only where they beat 16-bit maths
        if rates.get(low, 0) > rates["bf16"]:
            peak[low] = rates[low]
    dev_name, mem_total = device_description(device)
    dev = DeviceSpec(key=name, name=dev_name, memory_bytes=mem_total, bandwidth=bw, peak_flops=peak,
                     source=f"fewbits probe, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    measured = {"model": spec.name, "host": platform.node(), "torch": torch.__version__, "device": str(device),
                "threads": torch.get_num_threads(), "decode_path": "compiled" if compiled else "eager",
                "bandwidth": bw, "bandwidth_end": bw_end, "matmul_flops": measured_rates,
                "gemv_passes": passes,
                "gemv_sweeps_t_s": [{f: {k: v["t_s"] for k, v in r.items() if k.startswith("rows")}
                                     for f, r in sw.items()} for sw in sweeps],
                "step_costs": kv, "skeleton_linears_s": skel_lin,
                "width_cost_s": {str(b): v for b, v in width.items()},
                "probe_seconds": time.perf_counter() - t_start}
    return Profile(name=name, description=f"measured on this machine by fewbits probe ({spec.name} shapes)",
                   bandwidth_efficiency=bw_eff, head_bandwidth_efficiency=head_eff, head_compute_efficiency=head_comp,
                   compute_efficiency=comp_eff,
                   kv_compute_measured=True,
                   linear_call_overhead_s=call_extra, linear_call_per_seq_s=per_seq,
                   **width_fields(width),
                   bandwidth_curve=curve if len(curve) > 1 else (),
                   **fields, memory_headroom=DEFAULT.memory_headroom, weight_bytes="exact",
                   quantize_lm_head=False, quantize_embeddings=False, count_norms_and_biases=True,
                   low_precision_compute="int8" in peak or "fp8" in peak, host_overlap=not on_cpu, device=dev,
                   measured=measured)
