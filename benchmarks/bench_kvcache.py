"""KV cache: bytes per token per format, the largest context that fits a budget, and KL against the
16-bit cache at long context on SmolLM2-135M.

    python benchmarks/bench_kvcache.py [--budget-gb 1] [--context 2048] [--n-eval 128] [--threads N]

Memory figures are exact (KVFormat.nbytes, equal to what the store holds); KL follows
fewbits.kvcache.eval.kv_cache_kl on the packaged prose evaluation text (Python's own documentation).
"""

from __future__ import annotations

import argparse
import time

import torch

from fewbits.kvcache.format import parse_kv_format
from fewbits.models.presets import get_preset

FORMATS = ("bf16", "fp8-e4m3", "int8", "int4", "int2", "int4-r0", "int2-r0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget-gb", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048, help="tokens of context before the evaluated ones")
    ap.add_argument("--n-eval", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-kl", action="store_true", help="memory table only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = get_preset(args.model)
    L, H, D = spec.n_layers, spec.n_kv_heads, spec.head_dim
    budget = int(args.budget_gb * 1e9)
    print(f"{spec.name}: {L} layers x {H} KV heads x head dim {D}; budget {args.budget_gb:g} GB, batch {args.batch}")
    print(f"{'kv format':>12} {'bytes/token':>12} {'vs bf16':>8} {'max context':>12} {'bytes @ctx':>12}")
    b16 = parse_kv_format("bf16").bytes_per_token(L, H, D)
    for s in FORMATS:
        f = parse_kv_format(s)
        bpt = f.bytes_per_token(L, H, D)
        ctx = f.max_context(budget, L, H, D, args.batch)
        print(f"{s:>12} {bpt:12.0f} {b16 / bpt:7.2f}x {ctx:12d} {f.nbytes(args.context, L, H, D, args.batch):12d}")
    if args.no_kl:
        return
    from fewbits.data.texts import load_texts
    from fewbits.kvcache.eval import kv_cache_kl
    from fewbits.models.loading import load_model

    model, tok = load_model(args.model, dtype="bf16")
    text = load_texts("eval", ["prose"])["prose"]
    n = args.context + args.n_eval
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the evaluation text has {len(ids)} tokens, fewer than {n}")
    t0 = time.perf_counter()
    res = kv_cache_kl(model, torch.tensor([ids[:n]]), FORMATS, prefix=args.context, chunk=args.chunk)
    print(f"\nKL vs the bf16 cache, {args.n_eval} tokens after {args.context} of context "
          f"(chunks of {args.chunk}; {time.perf_counter() - t0:.0f} s)")
    print(f"{'kv format':>12} {'mean KL':>10} {'p99 KL':>10} {'top-1':>7} {'ppl':>8} {'ref ppl':>8}")
    for s, r in res.items():
        print(f"{s:>12} {r['mean_kl']:10.5f} {r['p99_kl']:10.5f} {r['top1_agree']:7.3f} {r['ppl']:8.3f} "
              f"{r['ref_ppl']:8.3f}")


if __name__ == "__main__":
    main()
