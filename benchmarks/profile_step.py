"""Where a decode step's time goes: step times, then a torch.profiler table of a few decode steps.

    python benchmarks/profile_step.py [MODEL] [--weights bf16,int8,int4-g32+a8] [--kv bf16] [--device cuda]
        [--random-weights] [--batch 1] [--prompt 128] [--steps 16] [--threads 1,0] [--top 20] [--eager]

Steps run on the compiled static-cache path (`fewbits.decode.generate.generate_static`, what `fewbits bench`
and `generate` run; `--eager`: the eager path).  For each weight format: the fastest and median decode step at
each --threads setting (0 = torch's default), then one profiled generate call: the operators that took the most
host (CPU) time, their call counts per step, and the device's busy time per step beside the step's wall time.
On a GPU, a step whose wall time is far above its device time is bound by the host launching kernels, not by
the weights.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from fewbits.bench.decode import load_quantized, split_activations
from fewbits.decode.generate import generate_static
from fewbits.generate import check_device, generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--weights", default="bf16,int8",
                    help="formats, comma-separated; a trailing +a8 (int4-g32+a8) lets the kernels round the "
                         "activations to int8")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", default="1,0", help="torch thread counts to time (0 = the default)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="the eager decode path instead of the compiled step")
    args = ap.parse_args()
    run = generate if args.eager else generate_static
    device = check_device(args.device)
    default_threads = torch.get_num_threads()
    for w in args.weights.split(","):
        spec, act = split_activations(w)  # +a8: kernels that round the activations to int8
        model, kernels = load_quantized(args.model, spec, device=str(device),
                                        random_weights=args.random_weights, activations=act)
        vocab = int(model.config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
        run(model, ids, 4, kv=args.kv)  # warm-up: compiles, allocator
        print(f"\n## {args.model} weights {w} ({kernels}), kv {args.kv}, batch {args.batch}, prompt {args.prompt}, "
              f"{device}, {'eager' if args.eager else 'compiled step'}")
        for th in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(th or default_threads)
            steps = []
            for _ in range(3):
                steps += run(model, ids, args.steps + 1, kv=args.kv).decode_step_s
            print(f"threads {torch.get_num_threads():>3}: step fastest {min(steps) * 1e3:7.2f} ms, "
                  f"median {statistics.median(steps) * 1e3:7.2f} ms ({len(steps)} steps)")
        torch.set_num_threads(default_threads)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            res = run(model, ids, args.steps + 1, kv=args.kv)
        n = len(res.decode_step_s) + 1  # the prefill is one forward too
        ev = prof.key_averages()
        dev_us = sum(e.self_device_time_total for e in ev) if device.type == "cuda" else 0.0
        wall = sum(res.decode_step_s) + res.prefill_s
        print(f"profiled: {n} forwards, wall {wall / n * 1e3:.2f} ms a forward (profiler on), "
              f"device busy {dev_us / n / 1e3:.2f} ms a forward")
        print(f"{'operator':<48} {'calls/fwd':>9} {'host ms/fwd':>11} {'dev ms/fwd':>10}")
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:args.top]:
            print(f"{e.key[:48]:<48} {e.count / n:9.1f} {e.self_cpu_time_total / n / 1e3:11.3f} "
                  f"{e.self_device_time_total / n / 1e3:10.3f}")
        del model


if __name__ == "__main__":
    main()
