"""16-bit matrix products on a CPU: torch's own bf16 / fp16 `F.linear` against the same product widened to fp32
(`fewbits.kernels.wide16.linear`: both operands converted, fp32 GEMM, result rounded back), per row count.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/bench_wide16.py [--rows 1,2,4,8,16,128,1536]
        [--dtypes bf16,fp16] [--shape 1536x576] [--rounds 5]

Rounds alternate between every (dtype, rows, path) cell; a round keeps the fastest of a few calls per cell and
the table shows the median over rounds. `ratio` is torch's time over the widened one's (> 1: widening pays).
`wide16.native_gemm` says for which dtypes this CPU has a fast 16-bit GEMM (then fewbits does not widen).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fewbits.kernels import wide16

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fastest(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,128,1536")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--shape", default="1536x576", help="weight out x in")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out, inp = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    cells = []
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        w = torch.randn(out, inp, generator=gen).to(dt)
        for r in (int(v) for v in args.rows.split(",")):
            x = torch.randn(r, inp, generator=gen).to(dt)
            cells.append((name, r, x, w))
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, r, x, w in cells:
            for path, fn in (("torch", F.linear), ("widened", _widened)):
                times.setdefault((name, r, path), []).append(_fastest(lambda fn=fn, x=x, w=w: fn(x, w)))
    print(f"weight {out}x{inp}, {args.threads} threads, median of {args.rounds} rounds; fast 16-bit GEMM here: "
          + ", ".join(f"{n} {wide16.native_gemm(DTYPES[n])}" for n in args.dtypes.split(",")))
    print(f"{'dtype':<6}{'rows':>6}{'torch ms':>11}{'widened ms':>12}{'ratio':>8}{'fewbits widens':>16}")
    for name, r, _, _ in cells:
        a, b = (statistics.median(times[(name, r, p)]) for p in ("torch", "widened"))
        widens = not wide16.native_gemm(DTYPES[name]) and r >= wide16.MIN_ROWS
        print(f"{name:<6}{r:>6}{a * 1e3:>11.3f}{b * 1e3:>12.3f}{a / b:>7.2f}x{str(widens):>16}")


if __name__ == "__main__":
    main()
