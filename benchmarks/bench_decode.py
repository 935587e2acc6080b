"""End-to-end decode of a packaged model per weight format and KV format, with the cost model's prediction.

    python benchmarks/bench_decode.py [--model smollm2-135m] [--profile device-profile.json] [--threads N]
                                      [--weights bf16,int8,int4-g64,fp8-e4m3] [--kv ...] [--steps 8]

The same as `fewbits bench MODEL`; without --profile the machine is probed first (as `fewbits probe`).
"""

from __future__ import annotations

import argparse

import torch

from fewbits.bench.decode import HEADER, load_quantized, model_spec, run_bench, summary
from fewbits.cost.profile import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--weights", default="bf16,int8,int4-g64,fp8-e4m3")
    ap.add_argument("--kv", default="bf16,fp8-e4m3,int8,int4,int2")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", default="128,512")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        prof = load_profile(args.profile)
    else:
        from fewbits.bench.probe import build_profile

        m, _ = load_quantized(args.model, "bf16")
        prof = build_profile(model_spec(args.model, m))
        del m
    print(HEADER)
    rows = run_bench(args.model, prof, tuple(args.weights.split(",")), tuple(args.kv.split(",")),
                     tuple(int(b) for b in args.batch.split(",")), tuple(int(p) for p in args.prompt.split(",")),
                     args.steps, args.full)
    print(summary(rows))


if __name__ == "__main__":
    main()
