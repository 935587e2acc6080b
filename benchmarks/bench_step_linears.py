"""The int8 matmuls of one compiled decode step, called in the step's order over the model's own weights (from
memory, as a step reads them), against the same calls through another version of the operators: a change to
``fewbits_rows::int8_mm`` measured where it counts, without the rest of the step's noise.

    git show HEAD~1:fewbits/kernels/rows.cpp > /tmp/rows_before.cpp
    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/bench_step_linears.py --baseline /tmp/rows_before.cpp \\
        [--model smollm2-135m] [--rows 1,8] [--rounds 12]

The weights are quantised to int8 (LM head included), the decoder built as `fewbits bench` builds it (q/k/v and
gate/up fused), and each of its int8 kernels called once per pass on a random bf16 x of `rows` rows.  Passes
alternate between the builds round by round; the table shows each build's median and fastest pass and the
baseline's median over this version's.  `bench_rows.py` times single shapes (its fastest call); a pass here is
what a step pays for its int8 matmuls on average, its weights never in cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="FILE", help="another version of fewbits/kernels/rows.cpp")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,8", help="rows of x (the batch), comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from fewbits.bench.decode import load_quantized
    from fewbits.decode.runner import StaticDecoder
    from fewbits.kernels import native, rows
    from fewbits.kernels.cpu_rows import Int8RowsKernel

    if not rows.available():
        raise SystemExit(f"no operators: {native.why(rows.NAME)}")
    ops = {"this": torch.ops.fewbits_rows.int8_mm}
    if args.baseline:
        ns = "fewbits_rows_baseline"
        if not rows.build_variant(ns, source=Path(args.baseline).read_text()):
            raise SystemExit(f"{args.baseline} did not build: {native.why(ns)}")
        ops["baseline"] = getattr(torch.ops, ns).int8_mm
    model, _ = load_quantized(args.model, "int8", lm_head="int8")
    counts = [int(r) for r in args.rows.split(",")]
    print(f"{args.model} int8 (head included), {args.threads} threads, median / fastest pass over {args.rounds} "
          "alternating rounds")
    print(f"{'rows':>4} {'calls':>5} {'MB':>6} " + " ".join(f"{k + ' ms':>16}" for k in ops)
          + (f" {'base / this':>11}" if len(ops) > 1 else ""))
    for m in counts:
        dec = StaticDecoder(model, "bf16", batch=m, max_len=64)
        kernels = []
        for fl in dec.fused.layers if dec.fused is not None else []:
            kernels += [p.kernel for p in (fl.qkv, fl.gate_up) if p is not None and p.kernel is not None]
        fused = {id(k) for k in kernels}
        for mod in model.modules():  # the unfused ones (o, down, the head); a fused group's parts are views
            k = getattr(mod, "kernel", None)
            if isinstance(k, Int8RowsKernel) and id(k) not in fused and not any(
                    k.q.untyped_storage().data_ptr() == f.q.untyped_storage().data_ptr() for f in kernels):
                kernels.append(k)
        g = torch.Generator().manual_seed(0)
        xs = {k.q.shape[1]: torch.randn(m, k.q.shape[1], generator=g).to(torch.bfloat16) for k in kernels}
        calls = [(xs[k.q.shape[1]], k.q, k.scales, k.corr, k.path) for k in kernels]
        times: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(args.rounds):
            for name, op in ops.items():
                for a in calls[:4]:
                    op(*a)
                t0 = time.perf_counter()
                for a in calls:
                    op(*a)
                times[name].append(time.perf_counter() - t0)
        mb = sum(k.q.numel() for k in kernels) / 1e6
        line = f"{m:>4} {len(calls):>5} {mb:>6.1f} " + " ".join(
            f"{statistics.median(v) * 1e3:>7.2f} / {min(v) * 1e3:>6.2f}" for v in times.values())
        if len(ops) > 1:
            line += f" {statistics.median(times['baseline']) / statistics.median(times['this']):>10.3f}x"
        print(line)


if __name__ == "__main__":
    main()
