"""The compiled static-cache decode (`fewbits.decode`): speed per weight format, KV formats at long context,
compile time cold and warm, greedy tokens against the eager path.  Ratios are taken side by side in one run,
rows alternating round by round (a shared host's drift hits all rows alike); each row keeps its fastest step
and its median, over the steps after `--warmup` untimed ones a round (`fewbits bench`'s 32 by default: the
last-level cache takes a model's weights back over the first steps after a prefill; 0 times every step, as
this script did before session 47).  Threads pinned (default 2).

    PYTHONPATH=. python benchmarks/bench_compiled.py speed  [--model smollm2-135m] [--weights bf16,int8,int4-g64]
                                                            [--lm-head same|none|FORMAT] [--kv bf16,int4-r16:where]
                                                            [--cpu-rows torch,fewbits]
                         (weights FORMAT:torch, e.g. int4-g32:torch: the <= 4-bit layers on torch's int4 operator;
                          FORMAT+a8, e.g. int4-g32+a8: activations rounded to int8 where a kernel can, cpu_q4_a8)
    python benchmarks/bench_compiled.py kv     [--weights int4-g64] [--kv bf16,int8,int4] [--prompt 2048]
                                               # (:where: a windowed cache's write in tensor operations;
                                               # int8:append: an int8 cache's write through append_kv)
    python benchmarks/bench_compiled.py attn   [--kv bf16,int8,int4-r16,int4-r16:where] [--prompt 2048,512]
                                               # one layer's attention and cache write (:where: the write in
                                               # tensor operations, FEWBITS_KV_APPEND=torch; :torch: no C++ at all)
    python benchmarks/bench_compiled.py compile [--weights int4-g32] [--kv bf16,int8,int4-r16] [--wrapper cpp,python]
                                                                                # cold, warm, warm
    python benchmarks/bench_compiled.py tokens [--model smollm2-135m] [--weights bf16,int8,int4-g32,int4-g64]
                                               [--kv bf16,int8,fp8-e4m3,int4-r16,int2-r16] [-n 64]

Goals (issue 16): int4-g64 >= 2.5x and int8 >= 1.7x the bf16 model's tok/s (batch 1 and 8); at 2048 tokens of
context an int8 / int4 cache at least as fast as the bf16 cache; compile < 60 s cold, < 5 s warm.  The
llama.cpp comparison is `benchmarks/compare_llamacpp.py` (compiled by default, --fewbits-gguf for fewbits'
own Q4_0 export).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch


def _head(args: argparse.Namespace, weights: str) -> str | None:
    """The LM head's format for a row of `weights`: the weights' own (`--lm-head same`, the default: the
    bytes ratios the issue quotes, ~3.5x for int4, count a quantised head), none (16-bit), or a format."""
    if weights in ("bf16", "fp16", "fp32") or args.lm_head == "none":
        return None
    return weights if args.lm_head == "same" else args.lm_head


def _load(args: argparse.Namespace, weights: str) -> torch.nn.Module:
    """The model in `weights`; "FORMAT:torch" (e.g. int4-g32:torch) runs its <= 4-bit layers on torch's int4
    operator instead of fewbits' own (``FEWBITS_CPU_INT4=torch`` while the kernels are prepared); a trailing
    "+a8" (int4-g32+a8) lets the kernels round the activations to int8 (`cpu_q4_a8`)."""
    from fewbits.bench.decode import load_quantized, split_activations

    spec, act = split_activations(weights)
    fmt, _, kernel = spec.partition(":")
    old = os.environ.get("FEWBITS_CPU_INT4")
    if kernel:
        os.environ["FEWBITS_CPU_INT4"] = kernel
    try:
        return load_quantized(args.model, fmt, lm_head=_head(args, fmt), activations=act)[0]
    finally:
        if kernel:
            os.environ.pop("FEWBITS_CPU_INT4") if old is None else os.environ.__setitem__("FEWBITS_CPU_INT4", old)


@contextlib.contextmanager
def _cpu_rows(variant: str) -> Iterator[None]:
    """FEWBITS_CPU_ROWS for one variant of a row: "torch" (torch's operators only) or "fewbits" (the few-row
    operators of `fewbits.kernels.rows` where they apply); "" leaves the environment as it is."""
    old = os.environ.get("FEWBITS_CPU_ROWS")
    if variant:
        os.environ["FEWBITS_CPU_ROWS"] = "torch" if variant == "torch" else "fewbits"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FEWBITS_CPU_ROWS", None)
        else:
            os.environ["FEWBITS_CPU_ROWS"] = old


def _rows(args: argparse.Namespace, rows: list[tuple[str, str, int, int]]) -> None:
    """Decode every (weights, kv, batch, prompt) row once per round, rounds alternating; print tok/s.  With
    --cpu-rows each row runs once per variant, on a model of its own loaded (kernels chosen) and compiled
    under that variant's FEWBITS_CPU_ROWS."""
    from fewbits.bench.timing import WARMUP_STEPS
    from fewbits.decode import cache
    from fewbits.decode.generate import generate_static
    from fewbits.generate import generate

    warmup = WARMUP_STEPS if args.warmup is None else args.warmup

    run = generate if args.eager else generate_static
    native_append, append_always = cache.NATIVE_APPEND, cache.APPEND_WITHOUT_WINDOW
    variants = [v for v in args.cpu_rows.split(",")] if args.cpu_rows else [""]
    rows = [(*r, v) for r in rows for v in variants]
    models = {}
    for w, v in dict.fromkeys((r[0], r[4]) for r in rows):
        with _cpu_rows(v):
            models[(w, v)] = _load(args, w)
    vocab = int(next(iter(models.values())).config.get_text_config().vocab_size)
    times: dict[tuple, list[float]] = {r: [] for r in rows}
    compile_s: dict[tuple, float] = {}
    for rnd in range(args.rounds):
        for r in rows if rnd % 2 == 0 else rows[::-1]:
            w, kv, b, p, v = r
            ids = torch.randint(0, vocab, (b, p), generator=torch.Generator().manual_seed(p + b))
            cache.NATIVE_APPEND = not kv.endswith(":where")  # int4-r16:where: FEWBITS_KV_APPEND=torch's cache write
            cache.APPEND_WITHOUT_WINDOW = kv.endswith(":append")  # int8:append: FEWBITS_KV_APPEND=always's
            try:
                with _cpu_rows(v):
                    res = run(models[(w, v)], ids, warmup + args.steps + 1,
                              kv=kv.removesuffix(":where").removesuffix(":append"))
            finally:
                cache.NATIVE_APPEND, cache.APPEND_WITHOUT_WINDOW = native_append, append_always
            timed = res.decode_step_s[warmup:]
            times[r] += timed
            compile_s[r] = compile_s.get(r, 0.0) + res.compile_s
            med = statistics.median(timed) * 1e3
            print(f"  round {rnd}: {w} kv {kv} batch {b} prompt {p}: {med:.2f} ms median step "
                  f"(compile {res.compile_s:.1f} s)", flush=True)
    base = {}
    print(f"{'weights':>16} {'kv':>9} {'batch':>5} {'prompt':>6} {'best ms':>8} {'median ms':>9} {'tok/s':>8} "
          f"{'vs first':>8} {'compile s':>9}")
    for r in rows:
        w, kv, b, p, v = r
        med = statistics.median(times[r])
        key = (b, p) if args.cmd == "speed" else (w, b, p)
        base.setdefault(key, med)
        label = f"{w}/{v}" if v else w
        print(f"{label:>16} {kv:>9} {b:>5} {p:>6} {min(times[r]) * 1e3:8.2f} {med * 1e3:9.2f} {b / med:8.1f} "
              f"{base[key] / med:7.2f}x {compile_s[r]:9.1f}")


def _attn(args: argparse.Namespace) -> None:
    """One layer's decode attention at `--prompt` tokens of context, compiled, per KV format: the cache write
    and the read of every slot (SmolLM2's heads: 9 query, 3 KV, 64 dims), alternating rounds.  Each round steps
    through 32 slots (a KIVI group's flush once per round); "best cycle mean" is the fastest round's mean call
    (the flush amortised, the steadiest figure on a shared host), beside the median and the fastest call."""
    for T in (int(p) for p in args.prompt.split(",")):
        _attn_at(args, T)


def _attn_at(args: argparse.Namespace, T: int) -> None:
    from fewbits.decode import kvkernel
    from fewbits.decode.cache import make_cache
    from fewbits.decode.step import _attend_codes, _attend_dense
    from fewbits.kernels import native

    torch._dynamo.config.recompile_limit = 64  # one graph per format and length, all of `step`
    print(f"int8/KIVI attention kernel: {'built' if kvkernel.available() else native.why(kvkernel.NAME)}")
    B, Hq, Hkv, D = int(args.batch.split(",")[0]), 9, 3, 64
    fns = {}
    for kv in args.kv.split(","):
        dense = kv.endswith(":sdpa")  # bf16:sdpa: the 16-bit cache through scaled_dot_product_attention instead
        plain = kv.endswith(":torch")  # int4:torch: inductor's fused reductions instead of `kvkernel`'s operator
        where = kv.endswith(":where")  # int4:where: the cache write in tensor operations, its flush under torch.where
        kv = kv.removesuffix(":sdpa").removesuffix(":torch").removesuffix(":where")
        (layer,) = make_cache(kv, 1, B, Hkv, D, T + 64, torch.bfloat16, "cpu")
        layer.kernel = layer.kernel and not plain
        layer.native_append = layer.native_append and not (plain or where)
        layer.prefill(torch.randn(B, Hkv, T, D).to(torch.bfloat16), torch.randn(B, Hkv, T, D).to(torch.bfloat16), 0)
        allowed = torch.zeros(B, 1, layer.t[next(iter(layer.t))].shape[2], dtype=torch.bool)
        allowed[:, :, :T + 1] = True

        def step(q, k, v, slot, layer=layer, allowed=allowed, dense=dense):  # noqa: ANN001, ANN202
            layer.step(k, v, slot)
            if dense and layer.fmt.kind == "float":
                return _attend_dense(q, layer.t["k"], layer.t["v"], allowed, 0.125)
            return _attend_codes(q, layer, allowed, slot, 0.125)

        label = kv + (":sdpa" if dense else ":torch" if plain else ":where" if where else "")
        fns[label] = torch.compile(step, fullgraph=True, dynamic=False)
    q, k = torch.randn(B, Hq, 1, D).to(torch.bfloat16), torch.randn(B, Hkv, 1, D).to(torch.bfloat16)
    # slots T .. T+31 in turn: a KIVI cache of groups of 32 (or fewer) flushes a group once per cycle
    slots = [torch.tensor([T + i]) for i in range(32)]
    t_compile = {}
    for kv, fn in fns.items():
        t0 = time.perf_counter()
        fn(q, k, k, slots[0])
        t_compile[kv] = time.perf_counter() - t0
    calls: dict[str, list[float]] = {kv: [] for kv in fns}  # every call's time
    cycles: dict[str, list[float]] = {kv: [] for kv in fns}  # per cycle of 32 slots: its mean call
    for rnd in range(args.rounds * 10):
        for kv in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            fn, ts = fns[kv], []
            for slot in slots:
                t0 = time.perf_counter()
                fn(q, k, k, slot)
                ts.append(time.perf_counter() - t0)
            calls[kv] += ts
            cycles[kv].append(sum(ts) / len(ts))
    first = next(iter(fns))
    for kv in fns:
        best, med = min(cycles[kv]), statistics.median(calls[kv])
        print(f"kv {kv:>15}: attention + write at {T} tokens, batch {B}: {best * 1e6:7.1f} us best cycle mean "
              f"({min(cycles[first]) / best:.2f}x the first), {med * 1e6:7.1f} us median call "
              f"({statistics.median(calls[first]) / med:.2f}x), {min(calls[kv]) * 1e6:7.1f} us fastest call; "
              f"compile {t_compile[kv]:.1f} s", flush=True)


def _compile_child(model: str, weights: str, kv: str, cache_dir: str, wrapper: str) -> None:
    """In a fresh process: build the decoder (compiling, or loading from `cache_dir`); print its wall time, the
    CPU time of this process and of its children (g++) over it, and one step's time."""
    import resource
    from pathlib import Path

    from fewbits.bench.decode import load_quantized
    from fewbits.decode import StaticDecoder, kvkernel
    from fewbits.kvcache.format import parse_kv_format

    m = load_quantized(model, weights)[0]

    def cpu() -> tuple[float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    t0, ck = time.perf_counter(), cpu()
    if parse_kv_format(kv).kind in ("int8", "kivi"):  # the C++ KV operators: built here when the cache is cold
        kvkernel.available()
    t_kernels, c_kernels = time.perf_counter() - t0, sum(cpu()) - sum(ck)
    c0 = cpu()
    dec = StaticDecoder(m, kv, 1, 256, cache_dir=Path(cache_dir), wrapper=wrapper)
    c1 = cpu()
    dec.prefill(torch.zeros(1, 128, dtype=torch.long))
    steps = []
    for _ in range(20):
        t0 = time.perf_counter()
        dec.step(torch.zeros(1, dtype=torch.long))
        steps.append(time.perf_counter() - t0)
    code = sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.suffix in (".cpp", ".py") and p.is_file())
    print(f"COMPILE {dec.compile_s:.2f} {c1[0] - c0[0]:.2f} {c1[1] - c0[1]:.2f} {statistics.median(steps) * 1e3:.2f} "
          f"{t_kernels:.2f} {c_kernels:.2f} {code}")


def _compile(args: argparse.Namespace) -> None:
    """Cold (an empty inductor cache directory and an empty $FEWBITS_CACHE, so fewbits' C++ operators are built
    too), then twice warm, each in a fresh process, per KV format and wrapper.  On a shared host the CPU seconds
    (the process's and g++'s; the whole process tree's) are steadier than the wall time."""
    import resource

    w = args.weights.split(",")[0]
    for kv in args.kv.split(","):
        for wrapper in args.wrapper.split(","):
            with tempfile.TemporaryDirectory() as d:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "FEWBITS_CACHE": os.path.join(d, "fb")}
                for label in ("cold", "warm", "warm"):
                    cmd = [sys.executable, __file__, "_compile_child", "--model", args.model, "--weights", w, "--kv",
                           kv, "--cache-dir", os.path.join(d, "inductor"), "--wrapper", wrapper, "--threads",
                           str(args.threads)]
                    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child's whole process tree
                    tree = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
                    wall, cpu, gxx, step, kern, kern_cpu, code = next(line.split()[1:] for line in out.splitlines()
                                                            if line.startswith("COMPILE"))
                    print(f"kv {kv:>9} {wrapper:>6} wrapper {label}: compile {float(wall):6.1f} s wall, "
                          f"{float(cpu):6.1f} s CPU + {float(gxx):5.1f} s CPU in g++ "
                          f"(before it: C++ KV operators {float(kern):5.1f} s wall, {float(kern_cpu):5.1f} s CPU); "
                          f"generated code {int(code) / 1e6:.2f} MB; {tree:6.1f} s CPU in the whole process tree "
                          f"(inductor's compile workers and their g++ included); then {float(step):.2f} ms a step "
                          f"({args.model}, {w}; load average {os.getloadavg()[0]:.2f})", flush=True)


def _tokens(args: argparse.Namespace) -> None:
    """Greedy tokens of the compiled step against the eager path (`fewbits.generate.generate`, transformers'
    forward over fewbits' KV store), per weight format and KV format.  At the first differing token it prints
    the eager path's margin between its top two logits there (a near tie flipping is rounding, not a bug)
    and the compiled step's logits' largest difference from the eager ones at the step before."""
    from fewbits.bench.decode import load_quantized
    from fewbits.decode.generate import decoder_for
    from fewbits.decode.runner import compile_scope
    from fewbits.generate import generate
    from fewbits.models.loading import load_tokenizer

    tok = load_tokenizer(args.model)
    ids = tok("The history of the printing press begins in", return_tensors="pt").input_ids
    n = args.n
    for w in args.weights.split(","):
        m = load_quantized(args.model, w)[0]
        for kv in args.kv.split(","):
            seen: list[torch.Tensor] = []  # the eager path's logits, taken at its LM head
            hook = m.lm_head.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out[:, -1].float()))
            try:
                ref = generate(m, ids, n, kv=kv).tokens[0]
            finally:
                hook.remove()
            ref_logits = torch.cat(seen)
            t0 = time.perf_counter()
            dec = decoder_for(m, kv, 1, ids.shape[1] + n)
            t_compile = time.perf_counter() - t0
            with torch.no_grad(), compile_scope():
                logits = [dec.prefill(ids)]
                got = [int(logits[-1].argmax(-1))]
                for _ in range(n - 1):  # greedy on its own tokens, as generate_static
                    logits.append(dec.step(torch.tensor([got[-1]])))
                    got.append(int(logits[-1].argmax(-1)))
            got_t = torch.tensor(got)
            same = int((ref == got_t).long().cumprod(0).sum())
            line = f"{w:>10} kv {kv:>13}: {same:2d}/{n} equal"
            if same < n:
                top2 = ref_logits[same].topk(2).values
                cl = logits[same].float()[0]
                line += (f", first difference at token {same}: eager margin {float(top2[0] - top2[1]):.4f}"
                         f" (top logit {float(top2[0]):.2f}), compiled picks {got[same]} at eager logit "
                         f"{float(ref_logits[same][got[same]]):.2f}; |compiled - eager| there "
                         f"{float((cl - ref_logits[same]).abs().max()):.4f}")
            line += f"  [compile {t_compile:.0f} s]"
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=["speed", "kv", "attn", "compile", "tokens", "_compile_child"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--kv", default=None)
    ap.add_argument("--batch", default=None, help="default 1,8 (speed), 1 (kv)")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=None,
                    help="speed/kv: untimed steps after each prefill (default fewbits bench's, 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens: greedy tokens compared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="speed/kv on the eager path instead")
    ap.add_argument("--lm-head", default="same",
                    help="LM head of the quantised rows: same (the weights' format), none (16-bit) or a format")
    ap.add_argument("--cpu-rows", default="",
                    help="speed/kv: run each row per variant, e.g. torch,fewbits (FEWBITS_CPU_ROWS: torch's operators "
                         "only, or the few-row operators of fewbits.kernels.rows); default: the environment's")
    ap.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--wrapper", default="cpp,python", help="compile: inductor's wrapper(s) of the CPU step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    defaults = {"speed": ("bf16,int8,int4-g64", "bf16", "128"), "kv": ("int4-g64", "bf16,int8,int4", "2048"),
                "compile": ("int4-g32", "bf16", "128"),
                "attn": ("", "bf16,int8,int8-r128,int4,int2,int4:torch", "2048,512"),
                "tokens": ("bf16,int8,int4-g32,int4-g64", "bf16,int8,fp8-e4m3,int4-r16,int2-r16", "8"),
                "_compile_child": ("int4-g32", "bf16", "128")}[args.cmd]
    args.weights = args.weights or defaults[0]
    args.kv = args.kv or defaults[1]
    args.prompt = args.prompt or defaults[2]
    args.batch = args.batch or ("1" if args.cmd in ("kv", "attn") else "1,8")
    if args.cmd == "_compile_child":
        return _compile_child(args.model, args.weights, args.kv, args.cache_dir, args.wrapper)
    print(f"{args.cmd}: {args.model}, LM head of quantised rows: {args.lm_head}, "
          f"threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, torch {torch.__version__}")
    if args.cmd == "compile":
        return _compile(args)
    if args.cmd == "tokens":
        return _tokens(args)
    if args.cmd == "attn":
        return _attn(args)
    rows = [(w, kv, int(b), int(p)) for w in args.weights.split(",") for kv in args.kv.split(",")
            for b in args.batch.split(",") for p in args.prompt.split(",")]
    _rows(args, rows)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
