"""Quantise + pack a 14336 x 4096 bf16 matrix (a Llama-3-8B MLP projection) to a format, and back.

Prints wall time and GB/s of packed codes each way (median of --repeat runs).  Target on a 2-core
machine: under 1 s each way for int4-g128.

    python benchmarks/bench_pack.py [--formats int4-g128,int8,...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fewbits import quantize_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int4-g128,int8,int3-g64,nf4-g64,fp8-e4m3,mxfp4,nvfp4")
    ap.add_argument("--shape", default="14336x4096")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows, cols = (int(d) for d in args.shape.split("x"))
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print(f"{rows}x{cols} bf16 ({w.numel() * 2 / 1e9:.3f} GB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeat}")
    print(f"{'format':<12} {'quantise s':>10} {'dequant s':>10} {'codes GB':>9} {'q GB/s':>7} {'dq GB/s':>8} "
          f"{'rel err':>8}")
    for spec in args.formats.split(","):
        tq, td = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            qt = quantize_tensor(w, spec)
            t1 = time.perf_counter()
            back = qt.dequantize(torch.bfloat16)
            t2 = time.perf_counter()
            tq.append(t1 - t0)
            td.append(t2 - t1)
        q, d = statistics.median(tq), statistics.median(td)
        gb = qt.codes.numel() / 1e9
        err = float((back.float() - w.float()).norm() / w.float().norm())
        print(f"{spec:<12} {q:10.3f} {d:10.3f} {gb:9.4f} {gb / q:7.3f} {gb / d:8.3f} {err:8.4f}")
        del qt, back


if __name__ == "__main__":
    main()
