"""Decode step time with the LM head kept 16-bit or quantised too, side by side in one run.

    python benchmarks/bench_lm_head.py [--model smollm2-135m,gemma-3-270m] [--weights int4-g64]
                                       [--heads bf16,int8,int4-g64] [--threads 1] [--rounds 5]

Per model: the linears in --weights (RTN, the kernel dispatcher's CPU paths) and the head in each of
--heads (`fewbits.bench.decode.load_quantized(..., lm_head=...)`); all variants stay loaded and are timed
in turns, round after round (batch 1, prompt --prompt random ids, 8 decode steps per round), and each
keeps its fastest step, so that a burst of load from another process hits all of them alike.  The
quality side is `fewbits eval` of `fewbits quantize MODEL --format F --lm-head H`.
"""

from __future__ import annotations

import argparse

import torch

from fewbits.bench.decode import load_quantized
from fewbits.generate import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m,gemma-3-270m")
    ap.add_argument("--weights", default="int4-g64", help="format of the other linear layers")
    ap.add_argument("--heads", default="bf16,int8,int4-g64", help="LM head formats; bf16 keeps it 16-bit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    print(f"torch {torch.__version__}, {args.threads} thread(s), linears {args.weights}, batch 1, prompt "
          f"{args.prompt}, fastest of {args.rounds} rounds x 8 steps")
    print(f"{'model':>14} {'LM head':>10} {'step ms':>8} {'tok/s':>7} {'vs bf16 head':>12}  kernels")
    for name in (m.strip() for m in args.model.split(",") if m.strip()):
        models = {h: load_quantized(name, args.weights, lm_head=None if h == "bf16" else h) for h in heads}
        vocab = int(next(iter(models.values()))[0].config.get_text_config().vocab_size)
        ids = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        best = dict.fromkeys(heads, float("inf"))
        for h in heads:
            generate(models[h][0], ids, 3)  # warm up
        for _ in range(args.rounds):
            for h in heads:
                best[h] = min(best[h], *generate(models[h][0], ids, 9).decode_step_s)
        base = best[heads[0]]
        for h in heads:
            print(f"{name:>14} {h:>10} {best[h] * 1e3:8.1f} {1 / best[h]:7.1f} {base / best[h]:11.2f}x  "
                  f"{models[h][1]}")
        del models


if __name__ == "__main__":
    main()
