"""Sweep the Triton weight-only kernels' tiles at decode shapes on a CUDA device, beside their own choice.

    python benchmarks/tune_gemv.py [--rows 1] [--specs int8,int4-g128,fp8-e4m3] [--shapes 14336x4096,...] [--min-mb 256]

For each shape and format every tile in the grid is timed as one CUDA-graph pass over copies of the weight
that exceed the L2 cache (fastest of --rounds replays): the tile product's (BLOCK_N, BLOCK_K, split-K)
(`--block-n`, `--block-k`, `--split`; printed `64x128/s4`) and, for up to `GEMV_MAX_ROWS` rows, the one-row
kernel's (BLOCK_N, BLOCK_K, warps) (`--gemv-n`, `--gemv-k`, `--warps`; printed `g8x512/w4`).  The table
prints the time and bandwidth of `decode_tiles`' pick, of the best tile found and of the three next best; a
bf16 row (torch's matmul over the same shape, as `bench_gemv.py` times it) gives the bandwidth to compare
with.  What it finds is for setting `fewbits.kernels.gpu.choose_tiles` / `choose_gemv_tiles`; it needs a
CUDA device with Triton.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from fewbits.bench.gemv import build_set, effective_spec, inputs_for
from fewbits.bench.timing import time_interleaved
from fewbits.formats.format import parse_format
from fewbits.generate import synchronizer
from fewbits.kernels.gpu import GEMV_MAX_ROWS, GemvTiles, Tiles, decode_tiles, gemv_ok

SHAPES = ((14336, 4096), (4096, 14336), (1536, 576), (576, 1536))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--specs", default="int8,int4-g128,fp8-e4m3")
    ap.add_argument("--min-mb", type=float, default=256.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--split", default="1,2,4,8")
    ap.add_argument("--gemv-n", default="2,4,8,16", help="the one-row kernel's BLOCK_N values")
    ap.add_argument("--gemv-k", default="256,512,1024", help="the one-row kernel's BLOCK_K values")
    ap.add_argument("--warps", default="4,8", help="the one-row kernel's warps a program")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="out x in, comma-separated")
    args = ap.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    sync = synchronizer("cuda")
    bns, bks, splits, gns, gks, warps = ([int(v) for v in a.split(",")] for a in (
        args.block_n, args.block_k, args.split, args.gemv_n, args.gemv_k, args.warps))
    bm = 16 if args.rows <= 16 else 64
    print(f"{torch.cuda.get_device_name()}, rows={args.rows}, CUDA-graph passes over >= {args.min_mb:.0f} MB")
    for shape in shapes:
        for spec0 in args.specs.split(","):
            spec = effective_spec(spec0, shape[1])
            fmt = parse_format(spec)
            ws = build_set(spec, (shape,), int(args.min_mb * 2**20), device="cuda")
            if ws.kernel_names != ("cuda_triton_weight_only",):
                print(f"{shape} {spec}: kernels {ws.kernel_names}, skipped")
                continue
            k0 = ws.kernels[0]
            per_channel = k0.ng == 1
            words = gemv_ok(k0.q, shape[1], k0.pack)
            pick = decode_tiles(args.rows, shape[0], shape[1], k0.group, per_channel, k0.pack, k0.programs, words)
            grid: set[Tiles] = {pick}
            for bn, bk, sp in itertools.product(bns, bks, splits):
                if not per_channel and k0.group % bk or (k0.pack == 2 and bk < 32) or sp > -(-shape[1] // bk):
                    continue
                grid.add((bm, bn, bk, sp))
            if args.rows <= GEMV_MAX_ROWS and words:
                grid.update(GemvTiles(bn, bk, w) for bn, bk, w in itertools.product(gns, gks, warps))
            x = inputs_for((shape,), args.rows, device="cuda")
            fns = {t: ws.graph_pass(x, tiles=t) for t in sorted(grid, key=str)}
            ref = build_set("bf16", (shape,), int(args.min_mb * 2**20), device="cuda")
            fns["bf16"] = ref.graph_pass(x)
            times = time_interleaved(fns, min_time=0.0, rounds=args.rounds, sync=sync)
            t16 = times.pop("bf16") / len(ref.kernels)
            ranked = sorted(times, key=times.get)
            cells = {t: _cell(t, times[t] / len(ws.kernels), ws.nbytes) for t in times}
            print(f"{shape[0]:>6} x {shape[1]:<6} {fmt.spec:>10}  bf16 {t16 * 1e6:6.1f} us "
                  f"{ref.nbytes / t16 / 1e9:6.0f} GB/s | pick {cells[pick]} | best {cells[ranked[0]]} | "
                  + " | ".join(cells[t] for t in ranked[1:4]))
            del fns, ws, ref


def _cell(t: Tiles, seconds: float, nbytes: int) -> str:
    """BLOCK_NxBLOCK_K/s<split> (the tile product) or gBLOCK_NxBLOCK_K/w<warps> (the one-row kernel), time per
    GEMV and bandwidth."""
    name = f"g{t.bn}x{t.bk}/w{t.warps}" if isinstance(t, GemvTiles) else f"{t[1]}x{t[2]}/s{t[3]}"
    return f"{name} {seconds * 1e6:6.1f} us {nbytes / seconds / 1e9:6.0f} GB/s"


if __name__ == "__main__":
    main()
