"""GEMV at decode shapes: bf16, fp32, int8 and int4-g128 side by side, in one run, through the dispatcher.

    python benchmarks/bench_gemv.py [--min-mb 600] [--rows 1] [--threads N]

Each format's weights are replicated until they exceed --min-mb (more than the last-level cache); each
sample multiplies by the next ~8 MB of copies (cold weights), the formats alternate sample by sample, and
the fastest sample of each counts (other processes only add time), so the ratios compare like with like.
Where in_features is not divisible by 128 (SmolLM2's 576), int4 uses the largest group that divides (g64)
and says so.
"""

from __future__ import annotations

import argparse

import torch

from fewbits.bench.gemv import GEMV_SHAPES, build_set, effective_spec, inputs_for
from fewbits.bench.timing import time_interleaved

SPECS = ("bf16", "fp32", "int8", "int4-g128")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--min-mb", type=float, default=600.0)
    ap.add_argument("--rows", type=int, default=1, help="batch rows of the input (1 = GEMV)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=60, help="samples per format (the fastest counts)")
    ap.add_argument("--shapes", default="", help="e.g. 14336x4096,1536x576 (default: all decode shapes)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = GEMV_SHAPES if not args.shapes else tuple(
        tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rows={args.rows}, "
          f"weights replicated to >= {args.min_mb:.0f} MB per format")
    print(f"{'shape (out x in)':>18} {'format':>10} {'kernel':>16} {'ms':>8} {'GB/s':>7} {'vs bf16':>8}")
    for shape in shapes:
        sets = {s: build_set(s, (shape,), int(args.min_mb * 2**20)) for s in SPECS}
        xs = {s: inputs_for((shape,), args.rows, torch.float32 if s == "fp32" else torch.bfloat16) for s in SPECS}
        per = {s: max(1, min(sets[s].copies, (8 << 20) // sets[s].nbytes)) for s in SPECS}  # ~8 MB a sample
        times = time_interleaved({s: sets[s].sampler(xs[s], per[s]) for s in SPECS}, min_time=0.0,
                                 rounds=args.rounds)
        t16 = times["bf16"] / per["bf16"]
        for s in SPECS:
            ws = sets[s]
            t = times[s] / per[s]
            label = effective_spec(s, shape[1])
            print(f"{shape[0]:>8} x {shape[1]:<7} {label:>10} {','.join(ws.kernel_names):>16} {t * 1e3:8.3f} "
                  f"{ws.nbytes / t / 1e9:7.1f} {t16 / t:7.2f}x")


if __name__ == "__main__":
    main()
