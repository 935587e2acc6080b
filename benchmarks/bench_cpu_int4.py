"""The CPU int4 linear at decode shapes: fewbits' own operator (`fewbits_q4::q4_mm`; `q4a8`: its int8-activation
path) beside torch's
(``aten._weight_int4pack_mm_for_cpu``, `Int4PackKernel`) and a bf16 F.linear, as GB/s of the weight bytes
each reads, beside a read of memory (`fewbits.bench.machine.memory_bandwidth`).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/bench_cpu_int4.py [--rows 1,8] [--spec int4-g32,int4-g64]
        [--models smollm2,gemma3] [--min-mb 256] [--rounds 40] [--avx2] [--loops] [--threads 1 --clock cpu]
        [--baseline OLD_CPU_INT4_CPP]

Shapes: the fused q/k/v, o, fused gate/up and down projections of SmolLM2-135M and Gemma-3-270M.  Each kernel's
weights are replicated until they exceed --min-mb (colder than the last-level cache); every sample multiplies
by the next ~8 MB of copies, the kernels alternate sample by sample in one process and the fastest sample
counts (other processes only add time).  "x torch" is the operator's speed over torch's.  --avx2 adds the
operator built without AVX-512 (``-mno-avx512f``: its AVX2 path, what an AVX2 machine runs), --loops its plain
loops, and --torch-avx2 runs torch's operator in its AVX2 build as well (``ATEN_CPU_CAPABILITY=avx2``, a second
process).  --baseline FILE adds the operator built from another version of cpu_int4.cpp (kernel "q4 baseline")
and a column "x base", the baseline's time over this version's, per q4 row: a change's before / after in one run,

    git show HEAD~1:fewbits/kernels/cpu_int4.cpp > /tmp/q4_before.cpp
    PYTHONPATH=. python benchmarks/bench_cpu_int4.py --rows 1,8 --kernels q4 --baseline /tmp/q4_before.cpp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from fewbits.bench.machine import memory_bandwidth
from fewbits.bench.timing import time_interleaved
from fewbits.kernels import cpu_int4
from fewbits.kernels.cpu import Int4PackKernel
from fewbits.tensor import quantize_tensor

#: (name, out, in): SmolLM2-135M (hidden 576, 9/3 heads of 64, MLP 1536) and Gemma-3-270M (hidden 640,
#: 4/1 heads of 256, MLP 2048), q/k/v and gate/up fused
SHAPES = {
    "smollm2": (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)),
    "gemma3": (("qkv", 1536, 640), ("o", 640, 1024), ("gate_up", 4096, 640), ("down", 640, 2048)),
}


class Dense:
    name = "bf16 F.linear"

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.to(torch.bfloat16).contiguous()
        self.nbytes = self.w.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def _interleaved_cpu(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Seconds of this process's CPU time per call, fastest of `rounds` samples taken in alternation: on a host
    shared with other processes, time spent descheduled does not count (use with --threads 1: with more, the
    threads' waiting at the end of each call counts too)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(3):
                fn()
            best[name] = min(best[name], (time.process_time() - t0) / 3)
    return best


def _copy_qt(qt):  # noqa: ANN001, ANN202
    return replace(qt, codes=qt.codes.clone(), scales=None if qt.scales is None else qt.scales.clone(),
                   zeros=None if qt.zeros is None else qt.zeros.clone())


def _avx2_class() -> type | None:
    """Q4Kernel on the operator built without AVX-512 (its own torch namespace), or None if it cannot build."""
    if not cpu_int4.build_avx2():
        print("build without AVX-512 failed:", cpu_int4.native.why(cpu_int4.AVX2_NAME))
        return None

    class Avx2(cpu_int4.Q4Kernel):
        name = "q4 no AVX-512"

        def __init__(self, qt) -> None:  # noqa: ANN001
            super().__init__(qt)
            self._op = torch.ops.fewbits_q4avx2.q4_mm.default

    return Avx2


def _baseline_class(path: str) -> type:
    """Q4Kernel on the operator built from another version of cpu_int4.cpp, under its own torch namespace."""
    from pathlib import Path

    name = "fewbits_q4base"
    if not cpu_int4.build_variant(name, Path(path).read_text()):
        sys.exit(f"{path} did not build: {cpu_int4.native.why(name)}")
    op = getattr(torch.ops, name).q4_mm.default

    class Base(cpu_int4.Q4Kernel):
        name = "q4 baseline"

        def __init__(self, qt) -> None:  # noqa: ANN001
            super().__init__(qt)
            self._op = op

    return Base


class _Loops(cpu_int4.Q4Kernel):
    name = "q4 plain loops"
    path = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--spec", default="int4-g32,int4-g64")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--min-mb", type=float, default=256.0)
    ap.add_argument("--sample-mb", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="q4,torch,bf16",
                    help="which of q4, q4a8 (int8 activations, fewer than 3 rows), torch, bf16 to time")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (a busy shared host; with --threads 1)")
    ap.add_argument("--avx2", action="store_true",
                    help="also the operator built without AVX-512 (its AVX2 path, what an AVX2 machine runs)")
    ap.add_argument("--loops", action="store_true", help="also the operator's plain loops (path 1)")
    ap.add_argument("--torch-avx2", action="store_true", help="also torch's operator in its AVX2 build")
    ap.add_argument("--baseline", metavar="FILE",
                    help="also the operator built from another version of cpu_int4.cpp, and a column of its time "
                         "over this one's ('x base'): before / after a change in one run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    kinds = args.kernels.split(",")
    makers: dict[str, object] = {}
    if "q4" in kinds:
        if not cpu_int4.available():
            sys.exit(f"the operator did not build: {cpu_int4.native.why(cpu_int4.NAME)}")
        makers["q4"] = cpu_int4.Q4Kernel
    if "q4a8" in kinds:
        if not cpu_int4.a8_path():
            sys.exit("the operator has no int8-activation path here (AVX512-VNNI or AVX2)")
        makers["q4a8"] = cpu_int4.Q4A8Kernel
    if "torch" in kinds:
        makers["torch"] = Int4PackKernel
    if args.avx2:
        cls = _avx2_class()
        if cls is not None:
            makers["q4 no AVX-512"] = cls
    if args.loops:
        makers["q4 plain loops"] = _Loops
    if args.baseline:
        makers["q4 baseline"] = _baseline_class(args.baseline)
    bw = memory_bandwidth(1 << 28)
    isa = "not built"
    if cpu_int4.available():
        code = int(torch.ops.fewbits_q4.q4_isa())
        # +4: the int8-activation path is built: vpdpbusd (AVX512-VNNI) on AVX-512, vpmaddubsw on AVX2
        isa = ("AVX2 + FMA" if code & 8 else {0: "portable", 1: "AVX512-BF16", 2: "AVX512-BF16 + AMX"}[code & 3]) + (
            (" + int8 x (vpmaddubsw)" if code & 8 else " + VNNI") if code & 4 else "")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, q4 path: "
          f"{isa}, memory read {bw / 1e9:.1f} GB/s, weights >= {args.min_mb:.0f} MB per kernel, "
          f"~{args.sample_mb:.0f} MB per sample, fastest of {args.rounds}")
    print(f"{'model':>8} {'layer':>8} {'shape':>11} {'spec':>9} {'rows':>4} {'kernel':>24} {'us':>8} {'GB/s':>6} "
          f"{'x mem':>6} {'x torch':>7} {'x bf16':>7}" + (f" {'x base':>7}" if args.baseline else ""))
    g = torch.Generator().manual_seed(0)
    for model in args.models.split(","):
        for layer, n, k in SHAPES[model]:
            w = torch.randn(n, k, generator=g) * 0.02
            for spec in args.spec.split(","):
                qt = quantize_tensor(w, spec)
                sets: dict[str, list] = {}
                for name, cls in makers.items():
                    first = cls(qt)
                    copies = max(1, int(args.min_mb * 2**20 // first.nbytes))
                    sets[name] = [first] + [cls(_copy_qt(qt)) for _ in range(copies - 1)]
                if "bf16" in kinds:
                    first = Dense(w)
                    copies = max(1, int(args.min_mb * 2**20 // first.nbytes))
                    sets["bf16"] = [first] + [Dense(w.clone()) for _ in range(copies - 1)]
                for m in rows:
                    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                    per = {s: max(1, min(len(ks), int(args.sample_mb * 2**20 // ks[0].nbytes))) for s, ks in
                           sets.items()}

                    def sampler(ks: list, p: int, x: torch.Tensor = x):  # noqa: ANN202
                        state = [0]

                        def run() -> None:
                            i = state[0]
                            for j in range(p):
                                ks[(i + j) % len(ks)](x)
                            state[0] = (i + p) % len(ks)

                        return run

                    fns = {s: sampler(ks, per[s]) for s, ks in sets.items()}
                    if args.clock == "cpu":
                        times = _interleaved_cpu(fns, args.rounds)
                    else:
                        times = time_interleaved(fns, min_time=0.0, rounds=args.rounds)
                    t = {s: times[s] / per[s] for s in sets}
                    for s, ks in sets.items():
                        gbs = ks[0].nbytes / t[s] / 1e9
                        vs_t = f"{t['torch'] / t[s]:6.2f}x" if "torch" in t else ""
                        vs_b = f"{t['bf16'] / t[s]:6.2f}x" if "bf16" in t else ""
                        vs_o = f"{t['q4 baseline'] / t[s]:6.2f}x" if s == "q4" and "q4 baseline" in t else ""
                        label = "bf16" if s == "bf16" else spec
                        print(f"{model:>8} {layer:>8} {f'{n}x{k}':>11} {label:>9} {m:>4} {s:>24} {t[s] * 1e6:8.1f} "
                              f"{gbs:6.1f} {gbs * 1e9 / bw:6.2f} {vs_t:>7} {vs_b:>7} {vs_o:>7}")
                del sets
    if args.torch_avx2 and "torch" in kinds:
        print("\ntorch's operator in its AVX2 build (ATEN_CPU_CAPABILITY=avx2):", flush=True)
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
        cmd = [sys.executable, __file__, "--rows", args.rows, "--spec", args.spec, "--models", args.models,
               "--min-mb", str(args.min_mb), "--rounds", str(args.rounds), "--threads", str(args.threads),
               "--kernels", "torch"]
        subprocess.run(cmd, env=env, check=False)


if __name__ == "__main__":
    main()
