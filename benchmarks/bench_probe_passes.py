"""The probe's GEMV passes made from Python against the same passes made from one compiled graph
(`fewbits.bench.gemv.compiled_calls`, what `fewbits probe` times on the compiled path), beside the model's own
compiled step: what of the step the passes leave to the cost model's other terms.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/bench_probe_passes.py \\
        [--model smollm2-135m] [--weights bf16,int8,int4-g64] [--rows 1,8] [--rounds 8]

Per format and rows of x, in one process, rounds alternating: the model's compiled decode step (the fastest of
16 after `fewbits bench`'s untimed warm-up steps, 128 cached tokens, 16-bit cache), then the probe's step set
(random weights of the model's shapes, q/k/v and gate/up fused, laid out in huge pages, one copy) followed by the
16-bit LM head, and the same calls on a tiny shape, each from Python and from one compiled graph (the fastest of
the round's samples, 40 a round: a last-level cache takes a set back over tens of passes).  "bytes" is a pass
less its tiny calls; "rest" is the step less the compiled pass (its calls included, as the probe counts it on
the compiled path) and the head: what the cost model's other terms (the skeleton's fixed cost, the width term,
attention) must give.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="bf16,int8,int4-g64")
    ap.add_argument("--rows", default="1,8", help="rows of x (the batch), comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from fewbits.bench.decode import load_quantized
    from fewbits.bench.gemv import build_step_set
    from fewbits.bench.probe import TINY, head_shape, named_layer_shapes, step_inputs
    from fewbits.bench.timing import WARMUP_STEPS
    from fewbits.decode import pages
    from fewbits.decode.generate import generate_static
    from fewbits.models.presets import get_preset

    spec = get_preset(args.model)
    print(f"{'weights':>9} {'rows':>4} {'step':>6} | {'python: pass':>12} {'tiny':>5} {'bytes':>6} | "
          f"{'compiled: pass':>14} {'tiny':>5} {'bytes':>6} | {'head':>5} {'rest':>5} | bytes py / compiled  (ms)")
    for w in args.weights.split(","):
        model = load_quantized(args.model, w)[0]
        body = build_step_set(w, named_layer_shapes(spec), 0)
        body = build_step_set(w, named_layer_shapes(spec), body.nbytes * spec.n_layers)
        head = build_step_set("bf16", (("lm_head", head_shape(spec)),), 0)
        pages.place([body, head])
        tiny = build_step_set(w, tuple((n, TINY) for n, _ in named_layer_shapes(spec)), 0)
        per_step = len(body.shapes) * spec.n_layers
        graphs: dict = {}
        for b in (int(r) for r in args.rows.split(",")):
            ids = torch.randint(0, spec.vocab_size, (b, 128), generator=torch.Generator().manual_seed(0))
            generate_static(model, ids, 3, kv="bf16")  # compiled (or loaded) before the rounds
            xs = step_inputs(tuple(body.shapes) + (TINY,), b)
            hx = step_inputs((head_shape(spec),), b)
            arms = {f"{way}_{part}": s.sampler(x, n, graphs if way == "c" else None)
                    for way in ("py", "c") for part, s, x, n in (("body", body, xs, per_step), ("head", head, hx, 1),
                                                                 ("tiny", tiny, xs, per_step))}
            best = {k: float("inf") for k in ["step", *arms]}
            with torch.no_grad():
                for _ in range(args.rounds):
                    step = min(generate_static(model, ids, WARMUP_STEPS + 17, kv="bf16").decode_step_s[WARMUP_STEPS:])
                    best["step"] = min(best["step"], step)
                    for way in ("py", "c"):
                        for _ in range(40):  # a pass: the step's linears, then the head
                            t0 = time.perf_counter()
                            arms[f"{way}_body"]()
                            t1 = time.perf_counter()
                            arms[f"{way}_head"]()
                            t2 = time.perf_counter()
                            best[f"{way}_body"] = min(best[f"{way}_body"], t1 - t0)
                            best[f"{way}_head"] = min(best[f"{way}_head"], t2 - t1)
                        for _ in range(8):
                            t0 = time.perf_counter()
                            arms[f"{way}_tiny"]()
                            best[f"{way}_tiny"] = min(best[f"{way}_tiny"], time.perf_counter() - t0)
            ms = {k: v * 1e3 for k, v in best.items()}
            py_bytes, c_bytes = ms["py_body"] - ms["py_tiny"], ms["c_body"] - ms["c_tiny"]
            rest = ms["step"] - ms["c_body"] - ms["c_head"]
            print(f"{w:>9} {b:>4} {ms['step']:6.2f} | {ms['py_body']:12.2f} {ms['py_tiny']:5.2f} {py_bytes:6.2f} | "
                  f"{ms['c_body']:14.2f} {ms['c_tiny']:5.2f} {c_bytes:6.2f} | {ms['c_head']:5.2f} {rest:5.2f} | "
                  f"{py_bytes / c_bytes:.3f}", flush=True)
        del model, body, head, tiny, graphs


if __name__ == "__main__":
    main()
