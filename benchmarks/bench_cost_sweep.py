"""Speed of the cost model: vectorised sweep rate and `fewbits plan` cold start.

    python benchmarks/bench_cost_sweep.py

Prints a table: configurations per second of `fewbits.cost.sweep` for growing grids (weight formats x
KV formats x batch x context), the scalar `plan()` rate, and the wall time of `fewbits plan` in a fresh
interpreter (cold start: imports included).  Targets: >= 100,000 configurations/s, cold start < 1 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np

from fewbits.cost import plan, sweep

WEIGHTS = ("bf16", "fp8-e4m3", "int8", "int4-g128", "int4-g64", "nvfp4")
KV = ("bf16", "fp8-e4m3", "int8", "int4-g32-asym", "int2-g32-asym")


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    print(f"{'grid (W x K x B x C)':<28}{'configs':>12}{'seconds':>10}{'configs/s':>14}")
    for nb, nc in ((8, 8), (64, 64), (256, 256), (512, 512)):
        batch, context = np.arange(1, nb + 1), np.linspace(128, 131072, nc).round()
        n = len(WEIGHTS) * len(KV) * nb * nc
        t = _best(lambda b=batch, c=context: sweep("llama-3-8b", "h100", b, c, WEIGHTS, KV))
        print(f"{f'{len(WEIGHTS)} x {len(KV)} x {nb} x {nc}':<28}{n:>12,}{t:>10.4f}{n / t:>14,.0f}")
    t = _best(lambda: [plan("llama-3-8b", "h100", b, 4096, table_weights=None) for b in range(1, 101)], 3)
    print(f"{'scalar plan() x 100':<28}{100:>12,}{t:>10.4f}{100 / t:>14,.0f}")
    cmd = [sys.executable, "-m", "fewbits", "plan", "--model", "llama-3-8b", "--device", "h100", "--batch", "16",
           "--context", "4096", "--weights", "int4-g128", "--kv", "fp8-e4m3"]
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        runs.append(time.perf_counter() - t)
    print(f"\n`fewbits plan` cold start: median {statistics.median(runs):.3f} s, best {min(runs):.3f} s "
          f"over {len(runs)} runs ({' '.join(cmd[1:4])} ...)")


if __name__ == "__main__":
    main()
