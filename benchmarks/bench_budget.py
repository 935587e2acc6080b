"""Mixed precision under a budget on SmolLM2-135M, on the methods benchmark's protocol
(benchmarks/bench_methods.py: calibration 16 x 256 packaged calibration tokens, evaluation 2 windows x
512 tokens per packaged evaluation category, KL(float || quantised) per token, exact dequantised weights).

    python benchmarks/bench_budget.py --part validate --json val.json   # proxy vs true single-layer KL
    python benchmarks/bench_budget.py --part curve --json curve.json    # uniform formats vs budgeted mixes
    python benchmarks/bench_budget.py --part report --inputs val.json curve.json --out benchmarks/results/budget

validate: the KL proxy of `fewbits.calib.sensitivity` against the true KL of the model on calibration
text when only that layer changes (a stratified sample of layers, every kind of linear, two formats),
as Spearman rank correlations for the three proxies measured.
curve: uniform GPTQ in each candidate format, and budgeted mixes at several bits per weight, among them
exactly the bytes of uniform int4-g64 (4.25 bits per weight): KL mean and per category, bytes, and the
cost model's predicted decode step (batch 1, context 2048) on --device.
report: the table, the KL-vs-bits-per-weight plot (matplotlib) and report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

CANDIDATES = ("int3-g64", "int3-g32", "int4-g64", "int4-g32", "int5-g64", "int5-g32", "int6-g64", "int8")
MIX_BPW = (3.5, 4.25, 5.0, 6.0)
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties among measured KLs): the Pearson correlation of the ranks."""
    import numpy as np

    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def setup(args: argparse.Namespace):  # noqa: ANN201
    import torch
    from bench_methods import calibration  # the methods benchmark's calibration windows

    from fewbits.models.loading import load_model

    torch.set_num_threads(args.threads)
    ref, tok = load_model(args.model, dtype="float32")
    data = calibration(tok, args.calib_windows, args.calib_len)
    names = [n for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    return ref, tok, data, names


def validate(args: argparse.Namespace) -> dict:
    from fewbits.calib.sensitivity import layer_kl, measure, reference_logprobs

    ref, tok, data, names = setup(args)
    blocks = sorted({int(n.split(".")[2]) for n in names})
    step = max(1, len(blocks) // args.sample_blocks)
    sample = [f"model.layers.{b}.{'self_attn' if k in KINDS[:4] else 'mlp'}.{k}"
              for i, b in enumerate(blocks[::step]) for k in (KINDS[i % 7], KINDS[(i + 3) % 7])]
    fmts = ("int3-g64", "int4-g64")
    t0 = time.perf_counter()
    sens = measure(ref, data, sample, fmts, args.method, keep=sample)
    t_measure = time.perf_counter() - t0
    truth_data = data[: args.truth_windows]
    lp = reference_logprobs(ref, truth_data)
    rows = []
    for n in sample:
        for f in fmts:
            true = layer_kl(ref, n, sens.w_hat[(n, f)], truth_data, lp)
            rows.append({"layer": n, "format": f, "true_kl": true, "kl": sens.kl[n][f],
                         "kl_weight": sens.kl_weight[n][f], "output_mse": sens.output_mse[n][f]})
            print(json.dumps(rows[-1]), flush=True)
    true = [r["true_kl"] for r in rows]
    return {"part": "validate", "method": args.method, "rows": rows, "seconds_measure": t_measure,
            "truth_tokens": int(truth_data.numel()),
            "spearman": {p: spearman([r[p] for r in rows], true) for p in ("kl", "kl_weight", "output_mse")},
            "spearman_int3_only": {p: spearman([r[p] for r in rows if r["format"] == "int3-g64"],
                                               [r["true_kl"] for r in rows if r["format"] == "int3-g64"])
                                   for p in ("kl", "kl_weight", "output_mse")}}


def curve(args: argparse.Namespace) -> dict:
    import copy

    from fewbits import api
    from fewbits.budgeted import budget_recipe
    from fewbits.calib.sensitivity import Sensitivity, measure
    from fewbits.data.texts import load_texts
    from fewbits.eval.perplexity import compare, fill_reference_cache, make_windows
    from fewbits.models.recipe import Recipe

    ref, tok, data, names = setup(args)
    windows, protocol = make_windows(tok, load_texts("eval"), seq_len=args.eval_len, n_windows=args.eval_windows)
    cache = fill_reference_cache(ref, windows, progress=False)
    t0 = time.perf_counter()
    cands = list(args.candidates)
    sens = None
    if args.sens and os.path.exists(args.sens):
        with open(args.sens) as f:
            sens = Sensitivity.from_dict(json.load(f))
    if sens is not None and args.truth_windows and not sens.truth:
        sens = None  # measured without the per-layer truth: measure again
    if sens is not None and not args.truth_windows:
        sens.truth = {}  # the raw proxy
    todo = [c for c in cands if sens is None or c not in sens.candidates]
    if todo:  # measure the candidates the saved file lacks, and keep them too
        new = measure(ref, data, names, todo if sens is not None else cands, args.method,
                      truth_windows=args.truth_windows if sens is None else 0)
        if sens is None:
            sens = new
        else:
            sens.candidates += todo
            for field in ("kl", "kl_weight", "output_mse"):
                for n in names:
                    getattr(sens, field)[n].update(getattr(new, field)[n])
        if args.sens:
            with open(args.sens, "w") as f:
                json.dump(sens.to_dict(), f)
    t_measure = time.perf_counter() - t0
    print(f"sensitivity measured in {t_measure:.0f} s", flush=True)
    runs: list[tuple[str, Recipe, dict]] = []
    raw = copy.copy(sens)
    raw.truth = {}
    variants = [("truth-rescaled mix", sens), ("mix", raw)] if args.raw_too and sens.truth else [("mix", sens)]
    for bpw in args.mix_bpw:
        for prefix, s in variants if bpw in args.raw_at else variants[-1:]:
            mix = budget_recipe(ref, data, f"bpw={bpw}", cands, args.method, device=args.device, sensitivity=s)
            runs.append((f"{prefix} bpw={bpw:g}", mix.recipe, {"counts": mix.counts(), "proxy_kl": mix.proxy_kl,
                                                                "step_s": mix.step_s, "uniform": mix.uniform}))
    uniform_figs = runs[0][2]["uniform"] if runs else {}
    for c in args.uniform:
        runs.append((f"uniform {c}", Recipe.from_format(c, args.method), {}))
    runs.sort(key=lambda r: 0 if "bpw=4.25" in r[0] or r[0] == "uniform int4-g64" else 1)  # the goal's rows first
    rows = []
    for label, recipe, extra in runs:
        model = copy.deepcopy(ref)
        t1 = time.perf_counter()
        rep = api.quantize(model, recipe, data, progress=False, chooser=api.kernel_chooser("reference"))
        seconds = time.perf_counter() - t1
        res = compare(model, None, windows, ref_cache=cache, progress=False)
        row = {"label": label, "bits_per_weight": rep.bits_per_weight, "size_bytes": rep.size_after,
               "linear_bytes": sum(r["bytes_after"] for r in rep.quantized_layers),
               "kl_mean": res["overall"]["kl_mean"], "kl_p99": res["overall"]["kl_p99"],
               "kl": {c: s["kl_mean"] for c, s in res["categories"].items()},
               "delta_ppl": {c: s["delta_ppl"] for c, s in res["categories"].items()}, "seconds": seconds, **extra}
        if label.startswith("uniform") and uniform_figs:
            row["predicted"] = uniform_figs.get(label.split()[1], {})
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "uniform"}), flush=True)
        del model
    return {"part": "curve", "method": args.method, "candidates": cands, "device": args.device,
            "protocol": protocol.text(),
            "calib": f"{data.shape[0]}x{data.shape[1]}", "threads": args.threads, "seconds_measure": t_measure,
            "truth_windows": args.truth_windows,
            "rows": rows}


def report(args: argparse.Namespace) -> None:
    from fewbits.eval.report import write_atomic

    parts = {}
    for p in args.inputs:
        with open(p) as f:
            d = json.load(f)
        if d["part"] == "curve" and "curve" in parts:  # more rows of the same protocol (e.g. uniform runs apart)
            parts["curve"]["rows"] += d["rows"]
        else:
            parts[d["part"]] = d
    os.makedirs(args.out, exist_ok=True)
    lines = ["# Mixed precision under a budget: SmolLM2-135M", ""]
    if "curve" in parts:
        cv = parts["curve"]
        rows = sorted(cv["rows"], key=lambda r: r["bits_per_weight"])
        cats = sorted({c for r in rows for c in r["kl"]})
        lines += [f"Method {cv['method']}; calibration {cv['calib']} tokens; {cv['protocol']}; "
                  f"predicted step: batch 1, context 2048 on {cv['device']}.", "",
                  "Sensitivities come from the calibration text only (the KL proxy; 'truth-rescaled mix': each "
                  "layer's proxy rescaled by its true single-layer KL on one calibration window). The KL below is "
                  "on the evaluation texts, which the choice never sees.", "",
                  "| run | bits/weight | linear bytes | KL mean | " + " | ".join(f"KL {c}" for c in cats)
                  + " | predicted step ms |", "|---" * (5 + len(cats)) + "|"]
        for r in rows:
            step = r.get("step_s") or r.get("predicted", {}).get("step_s")
            lines.append(f"| {r['label']} | {r['bits_per_weight']:.3f} | {r['linear_bytes']:,} | {r['kl_mean']:.4f} | "
                         + " | ".join(f"{r['kl'][c]:.4f}" for c in cats)
                         + (f" | {1e3 * step:.3f} |" if step else " | - |"))
        base = next((r for r in rows if r["label"] == "uniform int4-g64"), None)
        for mix in (r for r in rows if "mix bpw=4.25" in r["label"] and base):
            gain = 1 - mix["kl_mean"] / base["kl_mean"]
            lines += ["", f"{mix['label']}: at the bytes of uniform int4-g64 ({base['linear_bytes']:,} vs "
                      f"{mix['linear_bytes']:,} bytes) KL {mix['kl_mean']:.4f} against {base['kl_mean']:.4f}, "
                      f"{100 * gain:.1f}% lower (goal: 25%). Formats: {mix.get('counts')}."]
        _plot(rows, os.path.join(args.out, "kl_vs_bpw.png"), cv["method"])
        lines += ["", "![KL against bits per weight](kl_vs_bpw.png)"]
    if "validate" in parts:
        va = parts["validate"]
        lines += ["", f"## Proxy against the true single-layer KL ({len(va['rows'])} layer x format pairs, "
                  f"{va['truth_tokens']} calibration tokens, method {va['method']}, grid {va.get('grid', 'full')})", "",
                  "| proxy | Spearman (all pairs) | Spearman (int3-g64 only) |", "|---|---|---|"]
        for p, v in va["spearman"].items():
            lines.append(f"| {p} | {v:.3f} | {va['spearman_int3_only'][p]:.3f} |")
    write_atomic(os.path.join(args.out, "report.md"), "\n".join(lines) + "\n")
    for p, d in parts.items():
        write_atomic(os.path.join(args.out, f"{p}.json"), json.dumps(d, indent=1))
    print("\n".join(lines))


def _plot(rows: list[dict], path: str, method: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("uniform", "o"), ("mix", "s"), ("truth-rescaled mix", "^")):
        pts = sorted((r["bits_per_weight"], r["kl_mean"], r["label"]) for r in rows if r["label"].startswith(kind))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{kind} ({method})")
            if kind == "uniform":
                for x, y, lab in pts:
                    ax.annotate(lab.split()[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (quantised linears, scales included)")
    ax.set_ylabel("KL(float || quantised), nats/token")
    ax.set_title("SmolLM2-135M: uniform formats vs budgeted mixes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("validate", "curve", "report"), required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--device", default="h100", help="cost-model device for the predicted step")
    ap.add_argument("--candidates", nargs="*", default=list(CANDIDATES), help="curve: the mixes' candidates")
    ap.add_argument("--mix-bpw", type=float, nargs="*", default=list(MIX_BPW))
    ap.add_argument("--uniform", nargs="*", default=list(CANDIDATES))
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--sample-blocks", type=int, default=10, help="validate: blocks sampled (2 layers each)")
    ap.add_argument("--truth-windows", type=int, default=None,
                    help="calibration windows for the true KL (validate: 4; curve: per layer, the library's "
                    "default; 0: the raw proxy)")
    ap.add_argument("--raw-at", type=float, nargs="*", default=[4.25],
                    help="curve: the budgets at which both mixes are run (with --raw-too)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sens", help="curve: sensitivity JSON to reuse (measured and written when missing)")
    ap.add_argument("--raw-too", action="store_true",
                    help="curve, with --truth-windows: the raw proxy's mixes beside the truth-rescaled ones")
    ap.add_argument("--json")
    ap.add_argument("--inputs", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/budget")
    args = ap.parse_args()
    if args.truth_windows is None:
        from fewbits.budgeted import TRUTH_WINDOWS

        args.truth_windows = 4 if args.part == "validate" else TRUTH_WINDOWS
    if args.part == "report":
        report(args)
        return
    out = validate(args) if args.part == "validate" else curve(args)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
