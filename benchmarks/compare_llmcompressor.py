"""fewbits' GPTQ and AWQ beside llm-compressor's GPTQ on the same model, format and calibration tokens.

Format: int4, group 64, symmetric, every linear layer except the LM head (embeddings stay 16-bit too).
Calibration: the packaged calibration texts, N windows x L tokens (default 16 x 256), saved once to a
safetensors file so both tools see identical token ids.  llm-compressor pins its own transformers, so it
runs in its own virtual environment (a subprocess of this script with `--lc-worker`); it writes its
quantised-then-dequantised weights as dense float tensors, and this process evaluates them with
fewbits.eval against the float32 model on the packaged evaluation texts (the same windows for all rows).
fewbits' AWQ runs on the same ids and is scored on the same windows.  llm-compressor's AWQ is attempted
too; without an accelerator it crashes within seconds (in `pin_memory`), which the table note reports.

    python3 -m venv /tmp/lc && /tmp/lc/bin/pip install torch==2.13.0 \\
        && /tmp/lc/bin/pip install -c <(echo torch==2.13.0) llmcompressor
    python benchmarks/compare_llmcompressor.py --lc-python /tmp/lc/bin/python [--skip-lc-awq] [--threads 1] \\
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GROUP = 64


def lc_worker(args: argparse.Namespace) -> None:
    """Runs inside the llm-compressor environment: oneshot GPTQ (or AWQ), then dense weights to a
    safetensors file."""
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ids = load_file(args.calib)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype),
                                                 trust_remote_code=False)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": GROUP}}
    if args.lc_method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = AWQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    else:
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=int(ids.shape[0]),
            max_seq_length=int(ids.shape[1]))
    wall = time.perf_counter() - t0
    dense: dict[str, torch.Tensor] = {}
    worst = 0.0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        w = mod.weight.detach().float()
        scale = getattr(mod, "weight_scale", None)
        if scale is not None:  # check the stored weight is on the int4 grid its scales define
            s = scale.detach().float().repeat_interleave(GROUP, dim=1)[:, :w.shape[1]]
            w_grid = torch.clamp(torch.round(w / s), -8, 7) * s
            worst = max(worst, float((w_grid - w).abs().max()))
        dense[name + ".weight"] = w.contiguous()
    save_file(dense, args.out)
    info = {"wall_s": wall, "layers": len(dense), "off_grid_max": worst,
            "versions": {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers",
                                                    "torch")}}
    print("LC_RESULT " + json.dumps(info), flush=True)


def calibration_ids(tok, n: int, seq: int):  # noqa: ANN001, ANN201
    """The same windows `fewbits quantize` uses: packaged calibration texts, categories mixed."""
    from fewbits.cli.quantize import calibration_ids as cli_ids

    return cli_ids(tok, seq, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lc-python", default="/tmp/lc/bin/python", help="python of the llm-compressor venv")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=2, help="evaluation windows per text category")
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--workdir", default="/tmp", help="where the calibration ids and dense weights go")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both tools (0: torch's default)")
    ap.add_argument("--skip-lc-awq", action="store_true", help="do not attempt llm-compressor's AWQ")
    ap.add_argument("--repeat", type=int, default=1, help="GPTQ runs of each tool, alternating")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype both tools load and calibrate the model in (scored in float32 either way)")
    ap.add_argument("--lc-method", default="gptq", help=argparse.SUPPRESS)
    ap.add_argument("--lc-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calib", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lc_worker:
        lc_worker(args)
        return

    import copy

    import torch
    from safetensors.torch import save_file

    from fewbits import api
    from fewbits.data.texts import load_texts
    from fewbits.eval.perplexity import compare, fill_reference_cache, make_windows, reference_perplexity
    from fewbits.models.loading import load_model
    from fewbits.models.packaged import ensure_converted
    from fewbits.models.recipe import Recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = str(ensure_converted(args.model))
    ref, tok = load_model(args.model, dtype="float32")
    ids = calibration_ids(tok, args.calib_windows, args.calib_len).long().contiguous()
    os.makedirs(args.workdir, exist_ok=True)
    calib = os.path.join(args.workdir, "calib_ids.safetensors")
    save_file({"input_ids": ids}, calib)
    windows, protocol = make_windows(tok, load_texts("eval"), seq_len=args.eval_len, n_windows=args.eval_windows)
    cache = fill_reference_cache(ref, windows, progress=False)
    rows = [("float32", None, None, 0.0, 1.0, reference_perplexity(windows, cache)["overall"]["ppl"])]
    notes: list[str] = []

    def score(tool: str, model: torch.nn.Module, wall: float, total: float) -> None:
        o = compare(model, None, windows, ref_cache=cache, progress=False)["overall"]
        rows.append((tool, wall, total, o["kl_mean"], o["top1"], o["ppl"]))

    def fewbits_run(method: str) -> tuple[torch.nn.Module, float]:
        fb = copy.deepcopy(ref) if args.dtype == "float32" else load_model(args.model, dtype=args.dtype)[0]
        t0 = time.perf_counter()
        api.quantize(fb, Recipe.from_format(f"int4-g{GROUP}", method), data=ids, progress=False,
                     chooser=api.kernel_chooser("cached"))
        return fb, time.perf_counter() - t0

    # GPTQ of both tools, alternating, `--repeat` times (this host's speed drifts over minutes, so the
    # two tools are timed in turns and compared by their medians); quality is scored on the first run
    gptq_walls: dict[str, list[float]] = {"llm-compressor GPTQ": [], "fewbits GPTQ": []}
    for r in range(args.repeat):
        model, info, _ = lc_run(args, folder, calib, "gptq", ref)  # a GPTQ failure exits in lc_run
        gptq_walls["llm-compressor GPTQ"].append(info["wall_s"])
        if r == 0:
            score("llm-compressor GPTQ", model, info["wall_s"], info["total_s"])
            notes.append(f"llm-compressor GPTQ: {info['versions']}; {info['layers']} layers; stored weights "
                         f"off their int4 grid by at most {info['off_grid_max']:.2e}")
        del model
        fb, wall = fewbits_run("gptq")
        gptq_walls["fewbits GPTQ"].append(wall)
        if r == 0:
            score("fewbits GPTQ", fb.float(), wall, wall)
        del fb
    # AWQ: llm-compressor's (it needs an accelerator) and fewbits', once
    if not args.skip_lc_awq:
        model, info, failure = lc_run(args, folder, calib, "awq", ref)
        if model is None:
            notes.append(f"llm-compressor AWQ did not run: {failure}")
        else:
            score("llm-compressor AWQ", model, info["wall_s"], info["total_s"])
            del model
    fb, wall = fewbits_run("awq")
    score("fewbits AWQ", fb.float(), wall, wall)
    del fb

    print(f"{args.model}, int4 group {GROUP} symmetric, lm_head and embeddings unquantised; calibration "
          f"{args.calib_windows} x {args.calib_len} identical token ids; torch threads {torch.get_num_threads()};\n"
          f"both tools calibrate in {args.dtype}, "
          "every row is scored in float32 against the float32 model")
    print(protocol.text())
    for note in notes:
        print(note)
    print(f"{'tool':<22}{'wall s':>9}{'incl. start':>13}{'mean KL':>10}{'top-1':>8}{'ppl':>9}")
    for tool, wall, total, kl, top1, ppl in rows:
        w = f"{wall:9.1f}" if wall is not None else f"{'':>9}"
        t = f"{total:13.1f}" if total is not None else f"{'':>13}"
        print(f"{tool:<22}{w}{t}{kl:10.4f}{top1:8.3f}{ppl:9.2f}")
    if args.repeat > 1:
        for tool, walls in gptq_walls.items():
            print(f"{tool} wall s over {args.repeat} alternating runs: {', '.join(f'{w:.1f}' for w in walls)}; "
                  f"median {statistics.median(walls):.1f}")
    med = {tool: statistics.median(w) for tool, w in gptq_walls.items()}
    print(f"fewbits GPTQ is {med['llm-compressor GPTQ'] / med['fewbits GPTQ']:.1f}x faster than llm-compressor "
          f"GPTQ (quantisation wall time{', medians' if args.repeat > 1 else ''})")


def lc_run(args: argparse.Namespace, folder: str, calib: str, method: str, ref):  # noqa: ANN001, ANN201
    """llm-compressor's `method` in its venv -> (model with its dense weights, info, None), or
    (None, None, the error's last line) when it fails."""
    import copy

    import torch
    from safetensors.torch import load_file

    dense_path = os.path.join(args.workdir, f"lc_{method}_dense.safetensors")
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    t0 = time.perf_counter()
    proc = subprocess.run([args.lc_python, os.path.abspath(__file__), "--lc-worker", "--model", folder,
                           "--calib", calib, "--out", dense_path, "--lc-method", method,
                           "--threads", str(args.threads), "--dtype", args.dtype],
                          capture_output=True, text=True, env=env)
    total = time.perf_counter() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("LC_RESULT ")]
    if proc.returncode != 0 or not lines:
        err = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        if method == "gptq":
            sys.exit(f"llm-compressor run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return None, None, f"rc {proc.returncode} after {total:.0f} s: {err[-1] if err else 'no message'}"
    info = json.loads(lines[-1][len("LC_RESULT "):])
    info["total_s"] = total
    model = copy.deepcopy(ref)
    with torch.no_grad():
        for name, w in load_file(dense_path).items():
            model.get_submodule(name.removesuffix(".weight")).weight.copy_(w)
    return model, info, None


if __name__ == "__main__":
    main()
