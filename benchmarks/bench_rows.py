"""Decode-size matmuls (a few rows of activations) on a CPU: torch's operators against `fewbits.kernels.rows`,
as GB/s of weight bytes read, beside the machine's read bandwidth (`fewbits.bench.machine.memory_bandwidth`).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/bench_rows.py [--rows 1,8] [--rounds 7]
        [--shapes head-smollm2,head-gemma3,qkv,o,gateup,down] [--ops bf16,fp16,int8,int8-asym]
        [--portable] [--avx2] [--int8-fp32] [--baseline OLD_ROWS_CPP] [--clock wall|cpu --threads 1]

Shapes (out x in): the LM heads of SmolLM2-135M (tied embedding 49152 x 576) and Gemma-3-270M (262144 x 640),
and SmolLM2's layers (fused q/k/v 960 x 576, o 576 x 576, fused gate/up 3072 x 576, down 576 x 1536).  A
layer's weight is small enough to stay in cache, so it is timed over copies of it totalling --pool MB (a
decode step reads each layer's weight once, not from the core's own caches).  Per weight dtype: torch's
`F.linear` (bf16 / fp16) or `aten._weight_int8pack_mm` (int8, asymmetric: plus its rank-1 correction, as
`fewbits.kernels.cpu.Int8PackKernel` runs it) against the fewbits operator on the same tensors.  Rounds
alternate between every (shape, rows, op) cell; a round times each cell's calls one by one for ~--ms
milliseconds and keeps the fastest call (on a shared host most calls lose time slices to other processes),
and the table shows each cell's median over rounds of those; the ratio column is torch's time over the
fewbits operator's.  --portable adds the operators' plain-C++ path built without AVX-512 (-mno-avx512f).
--avx2 adds the AVX2 + FMA build on an AVX-512 CPU; --int8-fp32 adds, per build, int8_mm's path 1 (x in fp32 at one
row, where the AVX2 build's default multiplies one row of x as int16 blocks, `fewbits.kernels.act8.int16_blocks`).
--baseline FILE adds the operators built from another version of rows.cpp, and a column of the baseline's
time over this version's: a change's before / after in one run, e.g.

    git show HEAD~1:fewbits/kernels/rows.cpp > /tmp/rows_before.cpp
    PYTHONPATH=. python benchmarks/bench_rows.py --rows 7,8 --shapes down-gemma3,o-1b,gateup-1b,down-1b \
        --ops bf16,int8 --baseline /tmp/rows_before.cpp

Wider shapes than SmolLM2's (not run by default): Gemma-3-270M's down projection (640 x 2048), Llama-3.2-1B's
fused q/k/v (3072 x 2048), o (2048 x 2048), fused gate/up (16384 x 2048) and down (2048 x 8192).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"head-smollm2": (49152, 576), "head-gemma3": (262144, 640), "qkv": (960, 576), "o": (576, 576),
          "gateup": (3072, 576), "down": (576, 1536),
          # wider layers (not in the default list): Gemma-3-270M's down projection, Llama-3.2-1B's
          "down-gemma3": (640, 2048), "qkv-1b": (3072, 2048), "o-1b": (2048, 2048), "gateup-1b": (16384, 2048),
          "down-1b": (2048, 8192)}
DEFAULT_SHAPES = "head-smollm2,head-gemma3,qkv,o,gateup,down"


CLOCK = time.perf_counter


def _time(fn, calls: int) -> float:
    """The fastest of `calls` timed calls: on a shared host most calls lose time slices to other processes, the
    fastest one is the call that ran undisturbed."""
    best = float("inf")
    for i in range(calls):
        t0 = CLOCK()
        fn(i)
        best = min(best, CLOCK() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {','.join(SHAPES)}")
    ap.add_argument("--ops", default="bf16,fp16,int8,int8-asym")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", type=int, default=128, help="MB of copies a small layer's weight is rotated over")
    ap.add_argument("--portable", action="store_true")
    ap.add_argument("--avx2", action="store_true",
                    help="add the AVX2 + FMA build on an AVX-512 CPU (built apart with -mno-avx512f; on an AVX2 "
                         "CPU the native build, 'fewbits', is that one)")
    ap.add_argument("--int8-fp32", action="store_true",
                    help="add, per build, int8_mm's path 1 (x in fp32 at one row too) as '<build>:fp32x', beside "
                         "the default path (on AVX2 one row of x in int16 blocks); 16-bit ops call the same there")
    ap.add_argument("--baseline", metavar="FILE",
                    help="another rows.cpp (git show REV:fewbits/kernels/rows.cpp > FILE), built and timed beside "
                         "this one: a column 'baseline', before / after a change in one run")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (time.thread_time; needs --threads 1): what a call costs "
                         "when the host is too busy for any call to run undisturbed")
    ap.add_argument("--ms", type=float, default=30, help="milliseconds of calls per cell and round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu times this thread only: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    from fewbits.bench.machine import memory_bandwidth
    from fewbits.kernels import native, rows

    if not rows.available():
        raise SystemExit("fewbits.kernels.rows did not build: " + str(rows.why_not()))
    impls = {"fewbits": torch.ops.fewbits_rows}
    if args.portable:
        if not rows.build_portable():
            raise SystemExit("the portable variant did not build")
        impls["portable"] = getattr(torch.ops, rows.PORTABLE_NS)
    if args.avx2 and rows.built_isa() == 2:
        if not rows.build_avx2():
            raise SystemExit(f"the AVX2 variant did not build: {native.why(rows.AVX2_NS)}")
        impls["avx2"] = getattr(torch.ops, rows.AVX2_NS)
    if args.baseline:
        from pathlib import Path

        if not rows.build_variant("fewbits_rows_baseline", source=Path(args.baseline).read_text()):
            raise SystemExit(f"{args.baseline} did not build: {native.why('fewbits_rows_baseline')}")
        impls["baseline"] = torch.ops.fewbits_rows_baseline
    # label -> (operators, int8_mm's path; None for a baseline source, which may predate the argument)
    arms = {lab: (ns, None if lab == "baseline" else 0) for lab, ns in impls.items()}
    if args.int8_fp32:
        arms.update({f"{lab}:fp32x": (ns, 1) for lab, ns in impls.items() if lab != "baseline"})
    g = torch.Generator().manual_seed(0)
    shapes = [SHAPES[n] for n in args.shapes.split(",")]
    # one buffer per weight dtype; every weight (and every copy of a small one) is a view into it
    room = max(args.pool << 20, max(N * K * 2 for N, K in shapes))
    bufs = {torch.int8: torch.randint(-128, 128, (room,), dtype=torch.int8, generator=g)}
    bf = (torch.randn(room // 2, generator=g) * 0.05).to(torch.bfloat16)
    bufs[torch.bfloat16], bufs[torch.float16] = bf, bf.to(torch.float16)
    cells = []  # (label, bytes, fn) per (shape, rows, op, impl)
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        for op in args.ops.split(","):
            wdt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(op, torch.int8)
            per = N * K * (1 if wdt == torch.int8 else 2)
            copies = max(1, min(64, (args.pool << 20) // per))
            ws = [bufs[wdt][i * N * K:(i + 1) * N * K].view(N, K) for i in range(copies)]
            scales = (torch.rand(N, generator=g) * 0.01).to(torch.bfloat16)
            corr = torch.randn(N, generator=g) * 0.01 if op == "int8-asym" else None
            for M in (int(r) for r in args.rows.split(",")):
                x = torch.randn(M, K, generator=g).to(torch.float16 if wdt == torch.float16 else torch.bfloat16)
                if wdt == torch.int8:
                    def base(i, x=x, ws=ws, s=scales, c=corr):
                        y = torch.ops.aten._weight_int8pack_mm(x, ws[i % len(ws)], s)
                        return y if c is None else y + x.float().sum(-1, keepdim=True).to(x.dtype) * c.to(x.dtype)
                    fns = {"torch": base}
                    for lab, (ns, path) in arms.items():
                        fns[lab] = lambda i, x=x, ws=ws, s=scales, c=corr, ns=ns, p=path: ns.int8_mm(
                            x, ws[i % len(ws)], s, c, *(() if p is None else (p,)))
                else:
                    fns = {"torch": lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)])}
                    for lab, (ns, _) in arms.items():
                        fns[lab] = lambda i, x=x, ws=ws, ns=ns: ns.dense_mm(x, ws[i % len(ws)])
                for lab, fn in fns.items():
                    fn(0)
                    calls = max(3, int(args.ms * 1e-3 / max(_time(fn, 3), 1e-7)))
                    cells.append(((name, M, op, lab), per, fn, calls))
    bw = memory_bandwidth()
    times: dict[tuple, list[float]] = {c[0]: [] for c in cells}
    for rnd in range(args.rounds):
        for key, _, fn, calls in cells if rnd % 2 == 0 else cells[::-1]:
            times[key].append(_time(fn, calls))
    bw = max(bw, memory_bandwidth())
    print(f"torch {torch.__version__}, {args.threads} threads, {args.clock} clock, median over {args.rounds} "
          f"alternating rounds of each "
          f"round's fastest call; "
          f"memory_bandwidth {bw / 1e9:.1f} GB/s")
    labs = list(arms)
    head = f"{'shape':>13} {'N x K':>12} {'rows':>4} {'weights':>9} {'torch us':>9} {'GB/s':>6}"
    for lab in labs:
        head += f" {lab + ' us':>12} {'GB/s':>6} {'x torch':>7}"
    print(head + f" {'best/bw':>7}" + (f" {'vs base':>7}" if "baseline" in impls else ""))
    seen = []
    for key, per, _, _ in cells:
        k0 = key[:3]
        if k0 in seen:
            continue
        seen.append(k0)
        name, M, op = k0
        t = statistics.median(times[(*k0, "torch")])
        line = f"{name:>13} {'x'.join(map(str, SHAPES[name])):>12} {M:>4} {op:>9} {t * 1e6:9.1f} {per / t / 1e9:6.1f}"
        best = per / t
        for lab in labs:
            tl = statistics.median(times[(*k0, lab)])
            best = max(best, per / tl)
            line += f" {tl * 1e6:12.1f} {per / tl / 1e9:6.1f} {t / tl:6.2f}x"
        line += f" {best / bw:7.2f}"
        if "baseline" in impls:
            line += f" {statistics.median(times[(*k0, 'baseline')]) / statistics.median(times[(*k0, 'fewbits')]):6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
