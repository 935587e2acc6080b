"""Compiled decode step with q/k/v and gate/up fused (`fewbits.decode.fuse`) against the unfused step, side by side
in one process, rounds alternating (timing on a shared host drifts; only a ratio taken this way is meaningful).

    PYTHONPATH=. python benchmarks/bench_fuse.py --weights int4-g64 --lm-head int4-g64 [--model smollm2-135m]

Prints, per variant, the median and best step in ms over `rounds` x `steps` steps after a prompt of `prompt`
tokens (a 256-slot bf16 cache), the load average, and whether the two steps' logits agree.  ``--micro`` times
only the matmuls, eagerly: one layer's q/k/v and gate/up as the fused call against the parts' calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="int4-g64")
    ap.add_argument("--lm-head", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--micro", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from fewbits.bench.decode import load_quantized
    from fewbits.decode import StaticDecoder

    model = load_quantized(a.model, a.weights, lm_head=a.lm_head)[0]
    if a.micro:
        return micro(model, a)
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    decs = {}
    for name, fuse in (("unfused", False), ("fused", True)):  # a model each: fusing changes the parts' kernels
        m = model if fuse else load_quantized(a.model, a.weights, lm_head=a.lm_head)[0]
        decs[name] = StaticDecoder(m, "bf16", 1, 256, fuse=fuse)
        print(f"{name}: compile {decs[name].compile_s:.1f} s", flush=True)
    nxt = torch.zeros(1, dtype=torch.long)
    logits = {k: d.prefill(ids) for k, d in decs.items()}
    logits = {k: d.step(nxt).float() for k, d in decs.items()}
    diff = (logits["fused"] - logits["unfused"]).abs().max().item()
    same = bool(torch.equal(logits["fused"].argmax(-1), logits["unfused"].argmax(-1)))
    times: dict[str, list[float]] = {k: [] for k in decs}
    for _ in range(a.rounds):
        for k, d in decs.items():
            d.prefill(ids)
            for _ in range(a.steps):
                t0 = time.perf_counter()
                d.step(nxt)
                times[k].append(time.perf_counter() - t0)
    print(f"{a.model} {a.weights} lm_head={a.lm_head} threads={a.threads} load={os.getloadavg()[0]:.2f} "
          f"max|dlogit|={diff:.3g} same argmax={same}")
    for k, t in times.items():
        p10 = statistics.quantiles(t, n=10)[0]
        print(f"  {k:8s} median {statistics.median(t) * 1e3:6.2f} ms  p10 {p10 * 1e3:6.2f} ms  "
              f"best {min(t) * 1e3:6.2f} ms  ({len(t)} steps)")
    m = {k: statistics.median(t) for k, t in times.items()}
    b = {k: min(t) for k, t in times.items()}
    print(f"  fused/unfused ratio: median {m['fused'] / m['unfused']:.3f}, best {b['fused'] / b['unfused']:.3f}")


def micro(model: torch.nn.Module, a: argparse.Namespace) -> None:
    from fewbits.decode.fuse import fuse_projections

    layer = model.model.layers[0]
    parts = {"qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
             "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj]}
    f = fuse_projections(model, 1).layers[0]
    x = torch.randn(1, 1, model.config.hidden_size).to(torch.bfloat16)
    calls = {"qkv parts": lambda: [m(x) for m in parts["qkv"]], "qkv fused": lambda: f.qkv(x),
             "gate_up parts": lambda: [m(x) for m in parts["gate_up"]], "gate_up fused": lambda: f.gate_up(x)}
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for _ in range(a.rounds * 10):
            for k, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                times[k].append((time.perf_counter() - t0) / 20)
    print(f"{a.model} {a.weights} eager matmuls, threads={a.threads} load={os.getloadavg()[0]:.2f}")
    for k, t in times.items():
        print(f"  {k:14s} median {statistics.median(t) * 1e6:7.1f} us  best {min(t) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
