"""The probe's figures for linear layers: efficiencies and per-call costs from the GEMV passes
(`linear_efficiencies`), and the time the skeleton step spends in its own 16-bit linears: per call at batch 1
(`skeleton_linear_cost`, which a GPU's eager probe measures a quantised family's per-call cost against; a CPU's
sets it against the 16-bit tiny calls timed beside it), and their work
beyond a call's cost at each batch (`skeleton_rows_cost`), which is taken off the skeleton's steps
(`take_off_rows`); and what the step's own work between its matmuls (norms, residuals, the MLP's gate) costs at
the model's widths beyond the 16-wide skeleton's (`width_cost`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fewbits.cost.profile import A8_COMPUTE_MAX, format_family
from fewbits.formats.format import parse_format
from fewbits.models.spec import ModelSpec


def linear_efficiencies(spec: ModelSpec, passes: dict[str, dict[str, Any]], bw: float, peak_bf16: float,
                        log: Any = print, skeleton_linears_s: float | None = None,
                        bw_at: Callable[[float], float] | None = None
                        ) -> tuple[dict[str, float], float, dict[str, float], dict[str, float], float]:
    """From `gemv_passes`: (bandwidth efficiency per family, of the 16-bit LM head, compute efficiency per family,
    extra seconds per linear call per family, compute efficiency of the 16-bit LM head). Where the head's 8-row pass
    took over 1.15x its 1-row pass (compute-limited: the CPU's dense_mm at 8 rows), the head gets that compute
    efficiency of its own (the step model then gives it a roofline apart, see `fewbits.cost.step`) and the families'
    compute efficiencies are their linears' alone; else it is 0 and the families' include the head's 8-row time, as
    a step at the family's compute rate pays it. Without the head's own, a family whose linears stay memory-bound at
    8 rows (int4 here) had its 16-bit head charged the 1-row time at 8 rows (SmolLM2: ~1.9 ms where the probe
    measured 2.8). The 16-bit linears ("float") and the LM head every format keeps in 16 bits each stream at their
    own measured rate (here ~6.7 against ~8.4 GB/s: charging a quantised model's head at the rate of the 16-bit
    linears over-counted it ~1.3 ms per step); together they give the 16-bit model's time exactly as one blended
    efficiency did. The extra cost per call of a quantised family is its tiny calls' time less the 16-bit tiny
    calls' (both timed in the same loop; the skeleton step every prediction starts from pays a 16-bit call per
    linear), or less `skeleton_linears_s` where given (`skeleton_linear_cost`: what the skeleton's steps spend in
    their own 16-bit linears, ~4 ms a step, ~20 us a call; a GPU's eager probe). `bw_at(bytes)`: the bandwidth at
    a pass's working set (its `pool_bytes`, see `gemv_passes`), which its efficiency is relative to; else `bw`."""
    from fewbits.bench.gemv import split_a8
    from fewbits.bench.probe import head_shape, layer_shapes
    from fewbits.bench.stepfit import _clamp

    def beta(r: dict[str, Any]) -> float:
        return bw_at(float(r["pool_bytes"])) if bw_at is not None and r.get("pool_bytes") else bw

    bw_eff: dict[str, float] = {}
    comp_eff: dict[str, float] = {}
    h = passes["lm_head_bf16"]
    head_flops8 = 2 * 8 * head_shape(spec)[0] * head_shape(spec)[1]
    h1, h8 = h["rows1"]["t_s"], h["rows8"]["t_s"]
    head_comp = _clamp(head_flops8 / (h8 * peak_bf16)) if h8 > 1.15 * h1 else 0.0
    call_extra: dict[str, float] = {}
    for f, r in passes.items():
        if f == "lm_head_bf16":
            continue
        calls = r.get("calls", len(layer_shapes(spec)) * spec.n_layers)  # linear calls per step
        weights, a8 = split_a8(f)  # "int4-g64+a8": the kernels that round the activations to int8
        fam = format_family(parse_format(weights), "int8" if a8 else "auto")
        t1, t8 = r["rows1"]["t_bytes_s"], r["rows8"]["t_bytes_s"]
        bw_eff.setdefault(fam, _clamp(r["bytes"] / t1 / beta(r)))
        if fam != "float":  # the skeleton step below already pays a 16-bit call per linear
            base = passes["bf16"]["rows1"]["t_calls_s"] if skeleton_linears_s is None else skeleton_linears_s
            call_extra.setdefault(fam, (r["rows1"]["t_calls_s"] - base) / calls)
        if t8 > 1.15 * t1:  # compute-limited at 8 rows: the roofline's compute side
            # one compute rate per family for its linears' FLOPs (and the 16-bit head's, where it has none of its own)
            if head_comp:  # the head has its own
                eff = r["rows8"]["flops"] / (t8 * peak_bf16)
            else:
                eff = (r["rows8"]["flops"] + head_flops8) / ((t8 + h8) * peak_bf16)
            comp_eff.setdefault(fam, min(A8_COMPUTE_MAX, max(1e-3, eff)) if a8 else _clamp(eff))
        log(f"  {f:>9}: {r['bytes'] / 1e6:6.1f} MB of linears per step: 1 row {t1 * 1e3:7.2f} ms "
            f"(+{r['rows1']['t_calls_s'] * 1e3:.2f} ms calls), 8 rows {t8 * 1e3:7.2f} ms [{','.join(r['kernels'])}]")
    log(f"  bf16 LM head: {h['bytes'] / 1e6:.1f} MB, 1 row {h['rows1']['t_s'] * 1e3:.2f} ms, "
        f"8 rows {h['rows8']['t_s'] * 1e3:.2f} ms")
    return bw_eff, _clamp(h["bytes"] / h1 / beta(h)), comp_eff, call_extra, head_comp


def fastest_of_sweeps(sweeps: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several sweeps of `gemv_passes` (the same formats) as one: per format and rows, the fastest of the sweeps'
    passes, tiny calls and heads, each on its own (other processes only ever add time), and the bytes' share
    taken again from those as `gemv_passes` took it (`t_s - t_calls_s`; the whole pass where the format's
    `whole_pass` says so: a GPU's, or a compiled CPU step's).

    One sweep samples each format within a second or two: on a shared host a slow moment there stayed in the
    profile (SmolLM2's 16-bit pass at 1 row: 10.05 ms of bytes in one probe, 7.85 in the one before it and
    8.4-8.7 in five sweeps run alone after it), and every prediction of that family moved with it (+22%)."""
    if not sweeps:
        raise ValueError("fastest_of_sweeps needs at least one sweep of GEMV passes")
    first = sweeps[0]
    for other in sweeps[1:]:
        if set(other) != set(first):
            raise ValueError(f"GEMV sweeps over different formats: {sorted(first)} against {sorted(other)}")
    out: dict[str, dict[str, Any]] = {}
    for f, r in first.items():
        merged = dict(r)
        for key in [k for k in r if k.startswith("rows")]:
            runs = [s[f][key] for s in sweeps]
            row = dict(runs[0])
            for t in ("t_s", "t_calls_s", "t_head_s"):
                if t in row:
                    row[t] = min(x[t] for x in runs)
            if "t_bytes_s" in row:
                row["t_bytes_s"] = row["t_s"] if r.get("whole_pass") else max(row["t_s"] - row["t_calls_s"], 1e-9)
            merged[key] = row
        out[f] = merged
    return out


def call_growth(passes: dict[str, dict[str, Any]], calls_per_step: int, log: Any = print) -> dict[str, float]:
    """Seconds per linear call and sequence beyond the first, per family: how much a pass's tiny calls (each
    kernel's own fixed work, no bytes to speak of) grow from 1 to 8 rows of x, / (`calls_per_step` x 7), >= 0.
    `calls_per_step` is the cost model's count (`WeightTerms.linear_calls`: every projection a call), which the
    step model multiplies this by, so that the whole growth is charged where a pass fused q/k/v and gate/up into
    fewer calls.  Nothing else charges it: a pass's bytes are its time less its tiny calls' at the same rows, and
    the skeleton's steps lose their linears' work beyond a one-row call (`take_off_rows`).  On a 2-core AMX Xeon
    a SmolLM2 step's int8 tiny calls grew 1.46 -> 2.12 ms (packing x into the tiles, their drain), bf16's
    1.66 -> 1.87.  A format timed at one row only gets nothing."""
    from fewbits.bench.gemv import split_a8

    growth: dict[str, float] = {}
    for f, r in passes.items():
        if f == "lm_head_bf16" or "rows1" not in r or "rows8" not in r:
            continue
        weights, a8 = split_a8(f)
        fam = format_family(parse_format(weights), "int8" if a8 else "auto")
        g = max(r["rows8"]["t_calls_s"] - r["rows1"]["t_calls_s"], 0.0) / (calls_per_step * 7)
        growth.setdefault(fam, g)
    if growth:
        log("  calls' own work per extra row: " + ", ".join(f"{k} {v * 1e9:.0f} ns" for k, v in growth.items()))
    return growth


class _ZeroLinear(torch.nn.Module):
    """Stands in for a linear layer at no cost: the same zero output every call."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.outs: dict[tuple[Any, ...], torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (*x.shape[:-1], x.dtype, x.device)
        if key not in self.outs:
            self.outs[key] = torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        return self.outs[key]


def skeleton_linear_cost(spec: ModelSpec, context: int = 128, steps: int = 8, rounds: int = 5,
                         device: str | torch.device = "cpu") -> float:
    """Seconds a batch-1 decode step of `skeleton_model` spends in its decoder layers' own 16-bit linears:
    its fastest step less that of the same skeleton with each of them replaced by a zero output, in
    interleaved rounds (>= 0).  The skeleton's step, which the cost model starts from, pays this; a model
    whose linears run a quantised kernel does not (its calls cost what the GEMV passes measure)."""
    from fewbits.bench.probe import skeleton_model
    from fewbits.generate import generate

    models = [skeleton_model(spec, device), skeleton_model(spec, device)]
    for layer in models[1].model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for n, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, n, _ZeroLinear(mod.out_features))
    g = torch.Generator().manual_seed(2)
    best = [float("inf"), float("inf")]
    for m in models:
        generate(m, torch.randint(0, spec.vocab_size, (1, 16), generator=g), 3, kv="bf16")  # warm up
    for _ in range(rounds):
        for i, m in enumerate(models):
            ids = torch.randint(0, spec.vocab_size, (1, context), generator=g)
            best[i] = min(best[i], *generate(m, ids, steps + 1, kv="bf16").decode_step_s)
    return max(best[0] - best[1], 0.0)


def skeleton_rows_cost(model: torch.nn.Module, batches: tuple[int, ...], compiled: bool = True, rounds: int = 30,
                       calls: int = 10) -> dict[int, dict[str, float]]:
    """{batch: {"head": s, "layer": s}}: seconds a call of the skeleton's own 16-bit LM head, and of one decoder
    layer's linears, takes with `batch` rows of x beyond the same number of calls of a tiny 16-bit linear
    (`fewbits.bench.probe.TINY`, one row: the cost of a call without its work; >= 0), called as its step calls
    them (compiled: `fewbits.decode.step.linear16`, eager: the module), fastest of `rounds` rounds of `calls`
    calls, batches alternating (a fraction of a second: with 5 rounds one probe in four found SmolLM2's 16-bit head
    at batch 1 200-217 us over its tiny call where the others found 111-128, and its skeleton's fixed cost went
    with it, from ~0.65 to 0.09 ms a step; with 20, 117-121 us in four tries).

    The skeleton step would otherwise charge this work twice: its vocabulary-wide head makes batch x vocabulary
    outputs, each a sum and a store (~0.8 ms more at batch 8 than at batch 1 for SmolLM2's 49152 on an AVX2
    EPYC, 0.1 ms at batch 1), and the GEMV passes the cost model adds measure the real head and linears at each
    batch, their outputs included, less only the cost of their calls (`gemv_passes`' tiny calls), which the
    skeleton's steps keep."""
    from fewbits.bench.probe import TINY
    from fewbits.decode.step import linear16

    call = linear16 if compiled else (lambda m, x: m(x))
    layer = model.model.layers[0]
    parts = {"head": [model.lm_head], "layer": [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]}
    p = next(model.parameters())
    tiny = torch.nn.Linear(TINY[1], TINY[0], bias=False).to(dtype=p.dtype, device=p.device)
    g = torch.Generator().manual_seed(3)
    xs = {(b, k, i): torch.randn(b, 1, m.in_features, generator=g).to(dtype=p.dtype, device=p.device)
          for b in batches for k, ms in parts.items() for i, m in enumerate(ms)}
    x_tiny = torch.randn(1, 1, TINY[1], generator=g).to(dtype=p.dtype, device=p.device)
    runs = {(b, k): [(m, xs[(b, k, i)]) for i, m in enumerate(ms)] for b in batches for k, ms in parts.items()}
    runs.update({("tiny", k): [(tiny, x_tiny)] * len(ms) for k, ms in parts.items()})
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for _ in range(rounds):
            for key, run in runs.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    for m, x in run:
                        call(m, x)
                if p.device.type == "cuda":
                    torch.cuda.synchronize()
                best[key] = min(best[key], (time.perf_counter() - t0) / calls)
    return {b: {k: max(best[(b, k)] - best[("tiny", k)], 0.0) for k in parts} for b in batches}


def take_off_rows(fastest: dict[tuple[Any, ...], float], rows: dict[int, dict[str, float]]
                  ) -> dict[tuple[Any, ...], float]:
    """Skeleton step times {(kv, batch, context, depth): s} less their own linears' work at that batch
    (`skeleton_rows_cost`): the head once, a layer's linears `depth` times."""
    return {k: t - rows[k[1]]["head"] - k[3] * rows[k[1]]["layer"] for k, t in fastest.items()}


@torch.library.custom_op("fewbits_probe::stand_in", mutates_args=())
def stand_in(x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A linear layer's output shape at almost no cost: zeros, x's first columns copied in (so that every later
    operation depends on it). Opaque to the compiler, as the real matmul operators are, so the step's other work
    is compiled into the same kernels around it."""
    y = x.new_zeros(*x.shape[:-1], out_features)
    n = min(x.shape[-1], out_features)
    y[..., :n] = x[..., :n]
    return y


@stand_in.register_fake
def _stand_in_fake(x: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class StandInLinear(torch.nn.Module):
    """A linear layer of `out_features` outputs that holds no weight (`stand_in`)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fewbits_probe.stand_in(x, self.out_features)


def stand_in_model(spec: ModelSpec, hidden: int, intermediate: int, depth: int,
                   device: str | torch.device = "cpu") -> torch.nn.Module:
    """A Llama model with `spec`'s heads, KV heads, head size and vocabulary, `depth` layers, hidden states of
    `hidden` and MLPs of `intermediate`, every linear layer (the LM head too) a `StandInLinear`: its decode step is
    the step's work besides the matmuls at those widths.  Built without allocating the matmuls' weights (a
    Llama-3-8B's widths take ~1 GB, its embedding, not 16)."""
    from transformers import LlamaForCausalLM

    from fewbits.bench.probe import llama_config

    cfg = llama_config(spec, hidden, intermediate, depth, tie=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for parent in list(model.modules()):
        for name, mod in list(parent.named_children()):
            if isinstance(mod, torch.nn.Linear):
                setattr(parent, name, StandInLinear(mod.in_features, mod.out_features))
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding):
                m.weight.normal_(0.0, 0.02)
            elif hasattr(m, "variance_epsilon"):  # the RMS norms
                m.weight.fill_(1.0)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(cfg).to(device=device, dtype=torch.bfloat16)  # its buffers, computed
    return model.eval()


def width_cost(spec: ModelSpec, batches: tuple[int, ...] = (1, 8), depth: int | None = None, context: int = 128,
               steps: int = 16, rounds: int = 8, device: str | torch.device = "cpu") -> dict[int, float]:
    """{batch: seconds per layer and per element of width}: what a decode step's work besides its matmuls (the
    norms, residual adds, the MLP's activation and gate product, rotary, the embedding's row) costs at the
    model's widths (`spec.hidden_size + spec.intermediate_size` a row) beyond the 16-wide skeleton's, which the
    probe's fit starts from: compiled steps of two `stand_in_model`s of `depth` layers (default: the model's), one
    at the model's widths, one at the skeleton's (`fewbits.bench.probe.skeleton_model`), the same attention in
    both, in `rounds` alternating rounds; the median over the rounds of the difference of their fastest steps, /
    depth / the difference of their widths (>= 0).

    Measured because the skeleton's 16-wide steps miss it and it grows with the batch: SmolLM2 (576 + 1536), 30
    layers, 128 tokens, on a 2-core AVX-512 host: 0.11-0.21 ms a step at batch 1, 0.81-0.94 ms at batch 8, where
    the steps of its int4 and int8 models take 4-12 ms.  At the model's depth, not the skeleton's 6 layers: there
    the difference is a fifth as large against the same noise (6 layers x 5: 0.16-0.39 and 0.38-1.12 ms).  Both
    models' stand-ins write their outputs (zeros), which the GEMV passes count as well: a few kB a layer, ~1% of
    the difference at batch 8."""
    from fewbits.bench.probe import skeleton_widths
    from fewbits.decode.generate import generate_static

    widths = {"model": (spec.hidden_size, spec.intermediate_size), "skeleton": skeleton_widths(spec)}
    extra = sum(widths["model"]) - sum(widths["skeleton"])
    if extra <= 0:
        return dict.fromkeys(batches, 0.0)
    depth = depth or spec.n_layers
    models = {k: stand_in_model(spec, h, i, depth, device) for k, (h, i) in widths.items()}
    g = torch.Generator().manual_seed(4)
    out: dict[int, float] = {}
    for b in batches:
        ids = torch.randint(0, spec.vocab_size, (b, context), generator=g).to(device)
        for m in models.values():  # compiled (or loaded) once, before the timed rounds
            generate_static(m, ids, 2, kv="bf16")
        diffs = []
        for _ in range(rounds):
            best = {k: min(generate_static(m, ids, steps + 1, kv="bf16").decode_step_s) for k, m in models.items()}
            diffs.append(best["model"] - best["skeleton"])
        out[b] = max(statistics.median(diffs), 0.0) / depth / extra
    return out
