"""`fewbits bench`: measured decode step time and tokens/s per weight format and KV format, beside the
cost model's prediction from a measured device profile.

For each weight format the model is loaded in bf16 and its linear layers quantised (RTN, LM head and
embeddings kept 16-bit, layers whose shape a group size does not divide regrouped), with the kernel
dispatcher as the QuantLinear's kernel chooser.  Each row prefills `batch` random prompts of `prompt`
tokens, runs `warmup` decode steps untimed, then times `steps` decode steps with the KV cache in the row's
format; the row reports the fastest timed step (other processes only ever add time; see `timing.py`) and their
median beside it.  The untimed steps are the ones a last-level cache spends taking the weights back after the
prefill (or the other rows' models) used it: a decode re-reads the same weights every step, and on a 2-core
Emerald Rapids Xeon the int8 SmolLM2 step fell from 6.6-7.2 ms to a median of 4.3-4.6 over its first 6-10 steps
(`WARMUP_STEPS`), which the probe's passes and bandwidth curve measure as settled too.  The prediction
is `fewbits.cost.plan` at the mean context of the timed steps, with the KV format written out in full
(`KVFormat.full_spec`), so that the cost model counts the cache's true bytes, 16-bit window included.

By default every row decodes through the compiled static-cache step (`fewbits.decode`); its compile time
(or the time to load it from the on-disk cache) is reported apart (`compile_s`), never in a step's time.
``eager=True`` runs the model's own eager forward instead (the path before the compiled one).

On a CUDA device (``device="cuda"``) the model is loaded (or built) there and quantised where it lives, so
that the dispatcher prepares the CUDA kernels, and every timed step ends with a synchronisation (`generate`).
``random_weights`` builds the model from its architecture alone (`fewbits.models.loading.random_model`),
for machines where its weights cannot be had: a step's time depends on shapes and formats, not values.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fewbits.bench.timing import WARMUP_STEPS
from fewbits.cost.plan import plan
from fewbits.cost.profile import Profile
from fewbits.generate import generate
from fewbits.kvcache.format import parse_kv_format
from fewbits.models.spec import ModelSpec


@dataclass
class BenchRow:
    weights: str
    kv: str
    batch: int
    prompt: int
    steps: int
    measured_ms: float  # fastest step
    median_ms: float
    tokens_per_s: float
    predicted_ms: float
    error_pct: float  # (predicted - measured) / measured
    speedup_vs_16bit: float
    kernels: str
    kv_bytes: int
    bound: str
    lm_head: str = ""  # the LM head's format when quantised apart (quantised weight rows only)
    predicted_speedup: float = float("nan")  # the prediction's speedup vs its own 16-bit row (drift cancels)
    path: str = "eager"  # "compiled" (fewbits.decode's static graph) or "eager"
    compile_s: float = 0.0  # time to compile (or load from the disk cache) the row's step, not in the step times
    warmup: int = 0  # untimed steps after each prefill, before the timed ones

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_spec(name_or_path: str, model: torch.nn.Module) -> ModelSpec:
    """The cost model's description of the loaded model (preset when the name is one, else its config)."""
    from fewbits.models.presets import get_preset

    try:
        return get_preset(name_or_path)
    except Exception:  # noqa: BLE001 - not a preset: read the loaded model's own config
        cfg = model.config.to_dict()
        return ModelSpec.from_config_dict(cfg, source=str(name_or_path), name=Path(str(name_or_path)).name)


A8_SUFFIX = "+a8"


def split_activations(spec: str) -> tuple[str, str]:
    """A benchmark's weight spec -> (format spec, activations for `load_quantized`): a trailing "+a8"
    (int4-g32+a8) lets the kernels round the activations to int8 ("q8"), else the kernels are weight-only
    ("16")."""
    return (spec.removesuffix(A8_SUFFIX), "q8") if spec.endswith(A8_SUFFIX) else (spec, "16")


def load_quantized(name: str, weights: str, dtype: str = "bf16", device: str = "cpu",
                   random_weights: bool = False, lm_head: str | None = None,
                   activations: str = "16") -> tuple[torch.nn.Module, str]:
    """Load `name` on `device` (or build it with random weights) and quantise its linears to `weights` (the
    LM head to `lm_head` where given) with the fast kernels there; (model, kernel names).  `activations`
    "q8" lets the dispatcher choose kernels that also round the activations to int8 (e.g. `cpu_q4_a8`)."""
    from fewbits.api import quantize
    from fewbits.kernels import prepare_linear
    from fewbits.kernels.dispatch import prepare_linear_q8
    from fewbits.models.loading import load_model, random_model
    from fewbits.models.recipe import Recipe

    model = random_model(name, dtype, device) if random_weights else load_model(name, dtype=dtype, device=device)[0]
    if weights not in ("bf16", "fp16", "fp32"):
        if activations not in ("16", "q8"):
            raise ValueError(f"activations must be 16 or q8, got {activations!r}")
        chooser = prepare_linear if activations == "16" else prepare_linear_q8
        quantize(model, Recipe.from_format(weights, misfit="regroup", lm_head=lm_head), progress=False,
                 chooser=chooser)
    names = sorted({type(m.kernel).__name__ if not hasattr(m.kernel, "name") else m.kernel.name
                    for m in model.modules() if hasattr(m, "kernel")})
    return model, ",".join(names) or "dense"


class BenchMemoryError(ValueError):
    """The models a bench would hold at once do not fit in the device's free memory."""


def check_memory(name: str, weights: tuple[str, ...], batch: int, context: int, device: str,
                 lm_head: str | None = None) -> None:
    """Refuse, before loading anything, a bench whose models cannot all be held on `device`: every weight
    format's model stays loaded (the rows alternate between them), plus the 16-bit copy being quantised
    and a 16-bit cache of `batch` x `context` tokens' slots as the decoder preallocates them
    (`fewbits.decode.runner.cache_slots`), as the cost model counts them.  A model the cost model cannot describe
    without loading it (a hub id) is not checked."""
    from fewbits.bench.machine import memory_available
    from fewbits.decode.runner import cache_slots
    from fewbits.models.presets import resolve_model

    try:
        spec = resolve_model(name)
    except Exception:  # noqa: BLE001 - not a preset or a local config: nothing to check before loading
        return
    quantised = [w for w in weights if w not in ("bf16", "fp16", "fp32")]
    held = {w: plan(spec, "h100", 1, 1, w, table_weights=None, misfit="regroup",
                    lm_head=lm_head if w in quantised else None).memory_weights for w in weights}
    slots = cache_slots(context, parse_kv_format("bf16"), device)
    kv = plan(spec, "h100", batch, slots, "bf16", table_weights=None).memory_kv
    need = sum(held.values()) + (plan(spec, "h100", 1, 1, "bf16", table_weights=None).memory_weights
                                 if quantised and "bf16" not in held else 0.0) + kv
    have = memory_available(device)
    if need > have:
        parts = ", ".join(f"{w} {b / 1e9:.1f} GB" for w, b in held.items())
        raise BenchMemoryError(
            f"bench of {name} on {device} holds every weight format's model at once ({parts}, a 16-bit KV cache "
            f"of {batch} x {slots} slots {kv / 1e9:.1f} GB): {need / 1e9:.1f} GB, but {have / 1e9:.1f} GB is "
            "free; bench fewer --weights at a time, or a smaller model")


def _config_rows(weights: Iterable[str], kvs: Iterable[str], full: bool) -> list[tuple[str, str]]:
    weights, kvs = list(weights), list(kvs)
    rows = [(w, kvs[0]) for w in weights]
    rows += [(w, k) for w in weights for k in kvs[1:] if full or w == weights[0]]
    return rows


def run_bench(name: str, profile: Profile, weights: tuple[str, ...] = ("bf16", "int8", "int4-g64", "fp8-e4m3"),
              kvs: tuple[str, ...] = ("bf16", "fp8-e4m3", "int8", "int4", "int2"),
              batches: tuple[int, ...] = (1, 8), prompts: tuple[int, ...] = (128, 512), steps: int = 8,
              full: bool = False, seed: int = 0, log: Callable[[str], None] = print, rounds: int = 1,
              device: str = "cpu", random_weights: bool = False, lm_head: str | None = None,
              eager: bool = False, activations: str = "16", warmup: int = WARMUP_STEPS) -> list[BenchRow]:
    """Measure every (weights, kv, batch, prompt) row; `full` crosses all weight and KV formats (else
    the quantised weights run with the first KV format, and the other KV formats with the first weights).

    With `rounds` > 1 every row is measured once per round, round after round, and keeps its fastest step
    over all rounds: on a shared host whose speed drifts over minutes, this finds each row's quiet moment
    (all models stay loaded).  `lm_head`: the quantised weight formats' LM head format (the 16-bit rows
    keep theirs).  `activations`: "16" weight-only kernels, "q8" kernels that round the activations to int8 where
    they can (`load_quantized`).  `warmup`: untimed steps after each prefill (`WARMUP_STEPS`)."""
    by_weights: dict[str, list[str]] = {}
    for w, k in _config_rows(weights, kvs, full):
        by_weights.setdefault(w, []).append(k)
    check_memory(name, tuple(by_weights), max(batches), max(prompts) + warmup + steps + 1, device, lm_head)
    heads = {w: lm_head if w not in ("bf16", "fp16", "fp32") else None for w in by_weights}
    models = {w: load_quantized(name, w, device=device, random_weights=random_weights, lm_head=heads[w],
                                activations=activations)
              for w in by_weights}
    spec = model_spec(name, next(iter(models.values()))[0])
    vocab = int(next(iter(models.values()))[0].config.get_text_config().vocab_size)
    best: dict[tuple[str, str, int, int], tuple[float, list[float], int]] = {}
    paths: dict[tuple[str, str, int, int], tuple[str, float]] = {}
    if eager:
        run = generate
    else:
        from fewbits.decode.generate import generate_static as run
    for r in range(rounds):
        for w, kv_list in by_weights.items():
            model, _ = models[w]
            for kv in kv_list:
                kvf = parse_kv_format(kv)
                for b in batches:
                    for p in prompts:
                        g = torch.Generator().manual_seed(seed + b * 1000 + p)
                        ids = torch.randint(0, vocab, (b, p), generator=g)
                        res = run(model, ids, warmup + steps + 1, kv=kvf)
                        key = (w, kv, b, p)
                        paths[key] = (res.path, paths.get(key, ("", 0.0))[1] + res.compile_s)
                        times = best.get(key, (0.0, [], 0))[1] + list(res.decode_step_s[warmup:])
                        best[key] = (min(times), times, res.kv_nbytes)
        if rounds > 1:
            log(f"round {r + 1}/{rounds} done")
    rows: list[BenchRow] = []
    base: dict[tuple[str, int, int], float] = {}
    base_pred: dict[tuple[str, int, int], float] = {}
    for (w, kv, b, p), (t, times, kv_bytes) in best.items():
        kvf = parse_kv_format(kv)
        ctx = p + warmup + (steps + 1) // 2
        pr = plan(spec, batch=b, context=ctx, weights=w, kv=kvf.full_spec,  # the layers as quantised: regrouped
                  profile=profile, table_weights=None, table_kv=None, misfit="regroup", lm_head=heads[w],
                  activations="int8" if activations == "q8" else "auto")  # q8: the "+a8" families' figures
        if w == weights[0] and kv == kvs[0]:
            base[(kv, b, p)] = t
            base_pred[(kv, b, p)] = pr.time_s
        t16 = base.get((kvs[0], b, p), float("nan"))
        row = BenchRow(w, kvf.spec, b, p, steps, t * 1e3, statistics.median(times) * 1e3, b / t, pr.time_s * 1e3,
                       100.0 * (pr.time_s - t) / t, t16 / t, models[w][1], kv_bytes, pr.bound, heads[w] or "",
                       base_pred.get((kvs[0], b, p), float("nan")) / pr.time_s, *paths[(w, kv, b, p)],
                       warmup=warmup)
        rows.append(row)
        log(format_row(row))
    return rows


HEADER = (f"{'weights':>10} {'kv':>9} {'batch':>5} {'prompt':>6} {'measured ms':>11} {'median':>7} {'tok/s':>8} "
          f"{'vs 16-bit':>9} {'predicted ms':>12} {'error':>7} {'pred vs 16':>10}  {'KV MB':>6} {'compile s':>9}"
          "  kernels")


def format_row(r: BenchRow) -> str:
    weights = r.weights + (f"+h:{r.lm_head}" if r.lm_head else "")
    return (f"{weights:>10} {r.kv:>9} {r.batch:>5} {r.prompt:>6} {r.measured_ms:11.1f} {r.median_ms:7.1f} "
            f"{r.tokens_per_s:8.1f} "
            f"{r.speedup_vs_16bit:8.2f}x {r.predicted_ms:12.1f} {r.error_pct:+6.1f}% {r.predicted_speedup:9.2f}x  "
            f"{r.kv_bytes / 1e6:6.2f} {r.compile_s if r.path == 'compiled' else float('nan'):9.1f}  "
            f"{r.kernels}{'' if r.path == 'compiled' else ' (eager)'}")


def summary(rows: list[BenchRow], goal_pct: float = 15.0) -> str:
    """Rows whose predicted step time lies within `goal_pct` of the measured one; and, for the rows that are
    not the 16-bit baseline, how far the predicted speedup over it lies from the measured speedup (a ratio
    of two steps measured in the same run: a host that runs faster or slower than when it was probed
    shifts both alike, and cancels out)."""
    if not rows:
        return "no rows"
    errs = [abs(r.error_pct) for r in rows]
    within = sum(e <= goal_pct for e in errs)
    out = (f"{within}/{len(rows)} rows within {goal_pct:.0f}% of the measurement; "
           f"median |error| {statistics.median(errs):.1f}%, worst {max(errs):.1f}%")
    ratio = [abs(r.predicted_speedup / r.speedup_vs_16bit - 1) * 100 for r in rows
             if r.speedup_vs_16bit == r.speedup_vs_16bit and r.predicted_speedup == r.predicted_speedup
             and not (r.speedup_vs_16bit == 1.0 and r.predicted_speedup == 1.0)]
    if ratio:
        out += (f"; speedup vs 16-bit predicted within {goal_pct:.0f}% for {sum(e <= goal_pct for e in ratio)}/"
                f"{len(ratio)} rows (median |error| {statistics.median(ratio):.1f}%)")
    return out
