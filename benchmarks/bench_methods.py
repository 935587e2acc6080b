"""Calibrated methods against round-to-nearest on the packaged models: mean KL to the float model,
change in perplexity per text category, wall time of quantisation and peak memory.

Every (model, format, method) runs in its own subprocess so the peak resident memory is that run's:
"peak MiB" is the process's peak when quantisation ends (the float reference model, its copy being
quantised, the calibration), taken before the evaluation, whose full-vocabulary reference logits
(Gemma-3: 262k entries a token) would otherwise set it; "eval peak" is the whole run's.
Calibration: packaged calibration texts (verse, prose, code), N windows x L tokens (default 16 x 256).
Evaluation: packaged evaluation texts (never the same passages), W windows of S tokens per category.

    python benchmarks/bench_methods.py                       # the full table (SmolLM2 + Gemma-3 + W8A8)
    python benchmarks/bench_methods.py --only smollm2-135m:int4-g64:gptq --threads 1
    python benchmarks/bench_methods.py --only smollm2-135m:int2-g64:hqq --only smollm2-135m:int2-g64:rtn-asym
    python benchmarks/bench_methods.py --json results.json
    python benchmarks/bench_methods.py --only smollm2-135m:int4-g64:gptq --only smollm2-135m:int4-g64-narrow:gptq

Symmetric integer formats run on the full grid -2^(b-1)..2^(b-1)-1 unless spelled -narrow (-L..L, the grid
fewbits used before); the second line above compares the two.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

WEIGHT_METHODS = ("rtn", "gptq", "awq", "awq+gptq", "hqq")


def _weight_rows(model: str, specs: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """Every weight method per format, and RTN on the -asym variant: the baseline of HQQ (it runs with
    zero points, so on the -asym format)."""
    return [(model, f, m) for f in specs for m in (*WEIGHT_METHODS, "rtn-asym")]


TABLE = _weight_rows("smollm2-135m", ("int4-g64", "int3-g64", "int2-g64"))
TABLE += _weight_rows("gemma3-270m", ("int4-g128", "int3-g128"))
TABLE += [("smollm2-135m", "int8", m) for m in ("rtn", "w8a8", "smoothquant", "llm-int8")]


def calibration(tok, n: int, seq: int):  # noqa: ANN001, ANN201
    import torch

    from fewbits.data.texts import load_texts
    from fewbits.data.tokens import token_windows

    texts = load_texts("calib")
    per = -(-n // len(texts))
    return torch.cat([token_windows(tok, t, seq, n_windows=per) for t in texts.values()])[:n]


def run_one(model_name: str, spec: str, method: str, args: argparse.Namespace) -> dict:
    """Quantise one model in this process and compare it with the float model."""
    import copy

    import torch

    from fewbits import api
    from fewbits.data.texts import load_texts
    from fewbits.eval.perplexity import compare, fill_reference_cache, make_windows
    from fewbits.models.loading import load_model
    from fewbits.models.recipe import Recipe, Rule

    torch.set_num_threads(args.threads)
    ref, tok = load_model(model_name, dtype="float32")
    windows, protocol = make_windows(tok, load_texts("eval"), seq_len=args.eval_len, n_windows=args.eval_windows)
    data = calibration(tok, args.calib_windows, args.calib_len)
    model = copy.deepcopy(ref)
    options: dict = {}
    if method == "w8a8":  # plain W8A8 (no smoothing): the baseline SmoothQuant must beat
        method, options = "smoothquant", {"smooth": False}
    if method == "rtn-asym":
        method = "rtn"
        spec = spec if "asym" in spec else f"{spec}-asym"
    spec_used = f"{spec}-asym" if method == "hqq" and "asym" not in spec else spec
    recipe = Recipe((Rule(".*", spec_used, method, options),))
    t0 = time.perf_counter()
    # exact dequantised weights, dequantised on every call: KL, time and peak memory as measured before the
    # api's default became the fast kernels (bf16 activations, a packed copy of every weight)
    report = api.quantize(model, recipe, data, progress=False, chooser=api.kernel_chooser("reference"))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    cache = fill_reference_cache(ref, windows, progress=False)
    res = compare(model, None, windows, ref_cache=cache, progress=False)
    eval_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"model": model_name, "format": spec_used, "method": method if not options else "w8a8",
            "kl_mean": res["overall"]["kl_mean"], "kl_p99": res["overall"]["kl_p99"],
            "delta_ppl": {c: s["delta_ppl"] for c, s in res["categories"].items()},
            "ref_ppl": {c: s["ref_ppl"] for c, s in res["categories"].items()},
            "seconds": seconds, "peak_mib": peak, "eval_peak_mib": eval_peak, "bits_per_weight": report.bits_per_weight,
            "calib": f"{data.shape[0]}x{data.shape[1]}", "protocol": protocol.text(),
            "threads": args.threads}


def table(rows: list[dict]) -> str:
    cats = sorted({c for r in rows for c in r["delta_ppl"]})
    head = f"{'model':<14} {'format':<14} {'method':<11} {'mean KL':>8} " + " ".join(f"{'dppl ' + c:>11}" for c in cats)
    head += f" {'time s':>7} {'peak MiB':>9} {'eval peak':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<14} {r['format']:<14} {r['method']:<11} {r['kl_mean']:>8.4f} "
                     + " ".join(f"{r['delta_ppl'].get(c, float('nan')):>+11.3f}" for c in cats)
                     + f" {r['seconds']:>7.1f} {r['peak_mib']:>9.0f} {r.get('eval_peak_mib', float('nan')):>9.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="MODEL:FORMAT:METHOD (repeatable); default the full table")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1 is fastest on a busy machine)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(*args.child.split(":"), args)), flush=True)
        return
    todo = [tuple(o.split(":")) for o in args.only] if args.only else TABLE
    rows = []
    for model_name, spec, method in todo:
        cmd = [sys.executable, __file__, "--child", f"{model_name}:{spec}:{method}",
               "--calib-windows", str(args.calib_windows), "--calib-len", str(args.calib_len),
               "--eval-windows", str(args.eval_windows), "--eval-len", str(args.eval_len),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{model_name} {spec} {method}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[7:]))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if rows:
        print(f"\ncalibration {rows[0]['calib']} tokens; threads {args.threads}; evaluation protocol per model:")
        for model_name, protocol in dict((r["model"], r["protocol"]) for r in rows).items():
            print(f"  {model_name}: {protocol}")
        print()
        print(table(rows))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
