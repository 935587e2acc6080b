"""GPTQ's two calibration backends on SmolLM2-135M: wall time (medians of alternating runs) and how far
their codes differ.

The plain-torch column loop (`fewbits.methods.gptq.gptq_columns`, any device) and the compiled CPU one
(`fewbits.methods.gptq_loop`) quantise the same model; a third arm can run an older checkout of fewbits
(`--baseline DIR`, e.g. `git worktree add DIR main`) to check that the default CPU path has not slowed down.
Each run is its own process (the calibration backend is chosen by FEWBITS_CALIB_BACKEND), the arms in
turns, threads pinned.  Time is `api.quantize` alone (model loading and the calibration text excluded).
With `--codes`, one more run per backend stores every layer's unpacked codes and the script counts the
codes that differ (and the layers and rows they lie in); mean KL of each is what
`benchmarks/bench_methods.py` reports with FEWBITS_CALIB_BACKEND set.

    python benchmarks/bench_gptq_backends.py --repeat 5 --threads 1 --baseline /tmp/fewbits-main
    python benchmarks/bench_gptq_backends.py --repeat 0 --codes        # codes only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    """One quantisation in this process; prints RESULT {seconds}; with --save, stores the codes."""
    import torch
    from bench_methods import calibration

    from fewbits import api
    from fewbits.models.loading import load_model
    from fewbits.models.recipe import Recipe, Rule

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32")
    data = calibration(tok, args.calib_windows, args.calib_len)
    recipe = Recipe((Rule(".*", args.format, "gptq", {}),))
    t0 = time.perf_counter()
    api.quantize(model, recipe, data, progress=False, chooser="reference")
    seconds = time.perf_counter() - t0
    if args.save:
        codes = {n: m.qweight.unpacked_codes() for n, m in model.named_modules() if hasattr(m, "qweight")}
        torch.save(codes, args.save)
    print("RESULT " + json.dumps({"seconds": seconds}), flush=True)


def run(arm: str, args: argparse.Namespace, save: str | None = None) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    here = str(Path(__file__).resolve().parents[1])
    if arm == "baseline":
        env["PYTHONPATH"] = args.baseline
        env.pop("FEWBITS_CALIB_BACKEND", None)
    else:
        env["PYTHONPATH"] = here
        env["FEWBITS_CALIB_BACKEND"] = arm
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--format", args.format,
           "--threads", str(args.threads), "--calib-windows", str(args.calib_windows),
           "--calib-len", str(args.calib_len)] + (["--save", save] if save else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{arm}: failed\n{out.stderr[-3000:]}")
    return json.loads(line[7:])["seconds"]


def compare_codes(a_path: str, b_path: str) -> str:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    total = differ = rows = layers = 0
    for name, ca in a.items():
        d = ca != b[name]
        total += d.numel()
        differ += int(d.sum())
        rows += int(d.any(1).sum())
        layers += int(bool(d.any()))
    return (f"codes differing: {differ} of {total} ({differ / total:.2e}), in {rows} rows of {layers} of "
            f"{len(a)} layers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--format", default="int4-g64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per arm, taken in turns")
    ap.add_argument("--arms", default="numba,torch", help="comma-separated: numba, torch (and baseline)")
    ap.add_argument("--baseline", help="a directory holding another checkout's fewbits package: a third arm")
    ap.add_argument("--codes", action="store_true", help="also compare the two backends' codes")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    arms = args.arms.split(",") + (["baseline"] if args.baseline else [])
    times: dict[str, list[float]] = {a: [] for a in arms}
    for i in range(args.repeat):
        for arm in arms if i % 2 == 0 else arms[::-1]:  # alternate, so drift of the shared machine hits all arms
            times[arm].append(run(arm, args))
            print(f"run {i + 1} {arm}: {times[arm][-1]:.2f} s", flush=True)
    if args.repeat:
        print(f"\n{args.model} GPTQ {args.format}, {args.threads} thread(s), calibration "
              f"{args.calib_windows}x{args.calib_len}, median of {args.repeat} alternating runs:")
        for arm in arms:
            print(f"  {arm:<9} {statistics.median(times[arm]):7.2f} s   ({', '.join(f'{t:.2f}' for t in times[arm])})")
    if args.codes:
        with tempfile.TemporaryDirectory() as tmp:
            paths = {a: os.path.join(tmp, f"{a}.pt") for a in ("numba", "torch")}
            for arm, path in paths.items():
                run(arm, args, save=path)
            print(f"\nnumba vs torch, {compare_codes(paths['numba'], paths['torch'])}")


if __name__ == "__main__":
    main()
