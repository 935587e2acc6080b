"""GEMV at decode shapes: bf16, fp32, int8 and int4-g128 side by side, in one run, through the dispatcher.

    python benchmarks/bench_gemv.py [--min-mb 600] [--rows 1] [--threads N] [--device cuda] [--specs ...]

Each format's weights are replicated until they exceed --min-mb (more than the last-level cache); each
sample multiplies by the next ~8 MB of copies (cold weights), the formats alternate sample by sample, and
the fastest sample of each counts (other processes only add time), so the ratios compare like with like.
Where in_features is not divisible by 128 (SmolLM2's 576), int4 halves its group until it divides (g64)
and says so.  With --device cuda the kernels are the dispatcher's CUDA ones, each sample reads ~256 MB
(--sample-mb) and ends with a device synchronisation; each sample replays one pass over all copies captured
as a CUDA graph, so that the times are the kernels' own and not the host's launches (--eager launches
every call from Python, as eager decode does).
"""

from __future__ import annotations

import argparse

import torch

from fewbits.bench.gemv import GEMV_SHAPES, build_set, effective_spec, inputs_for
from fewbits.bench.timing import time_interleaved
from fewbits.generate import check_device, synchronizer

SPECS = ("bf16", "fp32", "int8", "int4-g128")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--min-mb", type=float, default=600.0)
    ap.add_argument("--rows", type=int, default=1, help="batch rows of the input (1 = GEMV)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=60, help="samples per format (the fastest counts)")
    ap.add_argument("--shapes", default="", help="e.g. 14336x4096,1536x576 (default: all decode shapes)")
    ap.add_argument("--specs", default=",".join(SPECS), help="weight formats, the first is the baseline")
    ap.add_argument("--device", default="cpu", help="cpu, or a CUDA device (cuda, cuda:1)")
    ap.add_argument("--sample-mb", type=float, default=0.0, help="weight bytes per sample (default 8 on the "
                    "CPU, 256 on a GPU, whose launches would otherwise dominate)")
    ap.add_argument("--eager", action="store_true", help="on a GPU: launch every call from Python instead of "
                    "replaying a CUDA graph (the time then includes the host's launch cost)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = check_device(args.device)
    except ValueError as exc:
        ap.error(str(exc))
    specs = tuple(s.strip() for s in args.specs.split(",") if s.strip())
    sample = int((args.sample_mb or (8 if device.type == "cpu" else 256)) * 2**20)
    shapes = GEMV_SHAPES if not args.shapes else tuple(
        tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    graphs = device.type == "cuda" and not args.eager
    print(f"torch {torch.__version__}, {where}, rows={args.rows}, {'CUDA graph replay, ' if graphs else ''}"
          f"weights replicated to >= {args.min_mb:.0f} MB per format, "
          + ("one pass over all copies per sample" if graphs else f"~{sample / 2**20:.0f} MB per sample"))
    print(f"{'shape (out x in)':>18} {'format':>10} {'kernel':>24} {'ms':>8} {'GB/s':>7} {'vs ' + specs[0]:>8}")
    for shape in shapes:
        sets = {s: build_set(s, (shape,), int(args.min_mb * 2**20), device=device) for s in specs}
        xs = {s: inputs_for((shape,), args.rows, torch.float32 if s == "fp32" else torch.bfloat16, device=device)
              for s in specs}
        if graphs:
            per = {s: len(sets[s].kernels) for s in specs}
            fns = {s: sets[s].graph_pass(xs[s]) for s in specs}
        else:
            per = {s: max(1, min(sets[s].copies, sample // sets[s].nbytes)) for s in specs}
            fns = {s: sets[s].sampler(xs[s], per[s]) for s in specs}
        times = time_interleaved(fns, min_time=0.0,
                                 rounds=args.rounds, sync=synchronizer(device))
        t16 = times[specs[0]] / per[specs[0]]
        for s in specs:
            ws = sets[s]
            t = times[s] / per[s]
            label = effective_spec(s, shape[1])
            print(f"{shape[0]:>8} x {shape[1]:<7} {label:>10} {','.join(ws.kernel_names):>24} {t * 1e3:8.3f} "
                  f"{ws.nbytes / t / 1e9:7.1f} {t16 / t:7.2f}x")
        del sets  # one shape's copies at a time


if __name__ == "__main__":
    main()
