"""The compiled decode step with `q4_mm`'s one-row int16 activations (`cpu_int4.int16_blocks`: vpmaddwd on
AVX2, vpdpwssd with AVX512-VNNI) beside the same step with x as it is (``Q4Kernel.path = 4``: AVX2's fp32 path,
AVX-512's vdpbf16ps): both compiled in one process (each its own cache folder), rounds alternating; each round's
median step of `--steps`, the median over rounds.  With ``--baseline FILE`` the second arm is the same step on the
operator built from another version of cpu_int4.cpp instead (a change's before / after, at any ``--batch``).

    PYTHONPATH=. python benchmarks/bench_x16_step.py [--model smollm2-135m] [--weights int4-g64] [--lm-head same]
        [--batch 1] [--rounds 8] [--steps 64] [--threads 2] [--baseline OLD_CPU_INT4_CPP]

On an AVX-512 CPU without VNNI both arms run vdpbf16ps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fewbits.bench.decode import load_quantized
from fewbits.decode.runner import StaticDecoder
from fewbits.kernels import cpu_int4
from fewbits.kernels.cpu_int4 import Q4Kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int4-g64")
    ap.add_argument("--lm-head", default="same", help="same (the weights' format), none (16-bit) or a format")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--baseline", metavar="FILE", help="another cpu_int4.cpp: its operator is the second arm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    head = {"same": args.weights, "none": None}.get(args.lm_head, args.lm_head)
    base_op = _baseline_op(args.baseline) if args.baseline else None
    other = "baseline" if base_op is not None else "exact x"
    decs = {}
    for arm, path in (("this" if base_op is not None else "int16 x", 0), (other, 0 if base_op is not None else 4)):
        Q4Kernel.path = path  # read by each kernel at its call: the compiled graph keeps the value it traced
        try:
            model, kernels = load_quantized(args.model, args.weights, lm_head=head)
            if arm == "baseline":
                for m in model.modules():
                    if isinstance(getattr(m, "kernel", None), Q4Kernel):
                        m.kernel._op = base_op
            decs[arm] = StaticDecoder(model, kv="bf16", batch=args.batch, max_len=256,
                                      cache_dir=Path(tempfile.mkdtemp()))
        finally:
            Q4Kernel.path = 0
        print(f"{arm}: {kernels}, compiled in {decs[arm].compile_s:.1f} s", flush=True)
    ids = torch.randint(0, 1000, (args.batch, 128), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {a: [] for a in decs}
    for rnd in range(args.rounds):
        for arm in list(decs) if rnd % 2 == 0 else list(decs)[::-1]:
            dec = decs[arm]
            dec.prefill(ids)
            tok, steps = torch.ones(args.batch, dtype=torch.long), []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = dec.step(tok)
                steps.append(time.perf_counter() - t0)
                tok = out.argmax(-1)
            times[arm].append(statistics.median(steps))
    med = {a: statistics.median(v) for a, v in times.items()}
    print(f"{args.model} {args.weights}, LM head {head or 'bf16'}, batch {args.batch}, {args.threads} threads, "
          f"{args.rounds} rounds")
    for arm, m in med.items():
        print(f"  {arm:>8}: median step {m * 1e3:6.2f} ms (fastest round {min(times[arm]) * 1e3:6.2f}), "
              f"{med[other] / m:.3f}x the {other} arm")


def _baseline_op(path: str) -> object:
    """`q4_mm` built from another version of cpu_int4.cpp, under its own torch namespace."""
    name = "fewbits_q4base"
    if not cpu_int4.build_variant(name, Path(path).read_text()):
        raise SystemExit(f"{path} did not build: {cpu_int4.native.why(name)}")
    return getattr(torch.ops, name).q4_mm.default

if __name__ == "__main__":
    main()
