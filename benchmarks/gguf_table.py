"""GGUF files at equal size: llama.cpp's own Q4_0, Q4_K_M and IQ4_NL beside fewbits' methods, one protocol.

    python benchmarks/gguf_table.py --llama-python /tmp/llv/bin/python --model gemma3-270m --threads 1 \
        --work /tmp/gg-gemma --json benchmarks/results/gguf/gemma3-270m.json

1. llama.cpp (llama-cpp-python's `llama_model_quantize`) makes Q4_0, Q4_K_M and IQ4_NL from fewbits'
   16-bit GGUF export of the model.
2. fewbits quantises the same model (fp32, the `fewbits quantize` default; calibration: the packaged
   calibration texts, 16 x 512 tokens as the CLI takes them) with RTN, GPTQ and AWQ+GPTQ into int4-g32
   (written as Q4_0), GPTQ into int5-g32 (Q5_0), and a GPTQ budgeted mix at exactly the linear layers'
   bytes of llama.cpp's Q4_K_M file (candidates int4-g32, int5-g32, int8-g32: the types GPTQ's codes
   travel into without re-rounding).  Every fewbits file stores the token embedding (a tied model's head
   too) in the type llama.cpp's Q4_K_M file gives it (`export_gguf(embedding=...)`, read from that
   file), so the files differ in their linear layers only.
3. Every file is read back by `fewbits.api.load_checkpoint` (what `fewbits eval FILE` does) and scored on
   `fewbits eval`'s protocol: the packaged evaluation texts (never the calibration texts), --windows
   windows of 512 tokens per kind, KL(fp32 model || file) per token, top-1 agreement.

Rows are written to --json as they finish; a re-run with the same --json skips the rows it holds.
`python benchmarks/gguf_table.py --table A.json [B.json ...]` prints the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

LLAMA_TYPES = ("Q4_0", "Q4_K_M", "IQ4_NL")
CANDIDATES = ("int4-g32", "int5-g32", "int8-g32")


def llama_quantize(llama_python: str, src: Path, dst: Path, ftype: str, threads: int) -> None:
    code = ("import ctypes, llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
            f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{ftype}; p.nthread = {threads}; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    subprocess.run([llama_python, "-c", code, str(src), str(dst)], check=True, capture_output=True)


def file_layout(path: Path, model) -> dict:  # noqa: ANN001
    """Types and bytes of a GGUF file's tensors: the embedding's type, and the linear layers' bytes and
    weights (the layers fewbits quantises: every decoder Linear, not the head)."""
    from gguf import GGUFReader

    from fewbits.export.gguf import _gguf_name, gguf_arch

    arch = gguf_arch(model)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    lin = [f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Linear" and n != "lm_head"]
    types: dict[str, int] = {}
    nbytes = numel = 0
    for key in lin:
        t = tensors[_gguf_name(arch, key)]
        nbytes += int(t.n_bytes)
        numel += int(t.n_elements)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    emb = tensors["token_embd.weight"]
    return {"embedding_type": emb.tensor_type.name, "linear_bytes": nbytes, "linear_weights": numel,
            "linear_types": types, "file_bytes": os.path.getsize(path)}


def _kl(v: float) -> str:
    return f"{v:.4f}" if v >= 1e-3 else f"{v:.1e}"


def table(paths: list[str]) -> str:
    """The markdown table of one or more --json results, rows by file size."""
    lines = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        lines += [f"{d['model']}: {d.get('protocol', '')}; every file's embedding {d['embedding']}.", "",
                  "| file | linear bpw | linear MB | file MB | KL | top-1 |", "|---|---|---|---|---|---|"]
        for r in sorted(d["rows"], key=lambda r: r["file_bytes"]):
            lines.append(f"| {r['label']} | {r['linear_bpw']:.3f} | {r['linear_bytes'] / 1e6:.1f} | "
                         f"{r['file_bytes'] / 1e6:.1f} | {_kl(r['kl_mean'])} | {r['top1']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--table":
        print(table(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--windows", type=int, default=2, help="evaluation windows of 512 tokens per kind of text")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--work", required=True, help="folder for the GGUF files (kept)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--rows", default="rtn,gptq,awq,gptq5,mix",
                    help="fewbits rows, in this order: rtn gptq awq (AWQ+GPTQ) gptq5 (int5-g32) mix (budgeted)")
    ap.add_argument("--sens-windows", type=int, default=0,
                    help="the mix: calibration samples its sensitivity is measured on (0: all; quantised on all)")
    ap.add_argument("--truth-windows", type=int, default=1,
                    help="the mix: calibration samples for each layer's true single-layer KL (0: the raw proxy)")
    args = ap.parse_args()

    import torch

    from fewbits import api
    from fewbits.cli.quantize import calibration_ids
    from fewbits.data.texts import load_texts
    from fewbits.eval import run
    from fewbits.eval.perplexity import compare, fill_reference_cache
    from fewbits.export.gguf import export_gguf
    from fewbits.export.gguf_vocab import is_byte_level_bpe
    from fewbits.formats.ggml_types import GGML_TYPES
    from fewbits.models.loading import load_model
    from fewbits.models.packaged import gguf_tokenizer_pre, source_gguf

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = json.loads(Path(args.json).read_text()) if os.path.exists(args.json) else {"model": args.model, "rows": []}
    done = {r["label"] for r in out["rows"]}

    def save() -> None:
        tmp = args.json + ".tmp"
        Path(tmp).write_text(json.dumps(out, indent=1))
        os.replace(tmp, args.json)

    pre = gguf_tokenizer_pre(args.model)
    ref, tok = load_model(args.model, dtype="fp32")
    wins, protocol = run.causal_windows(tok, load_texts("eval"), 512, args.windows)
    out["protocol"] = protocol.text()
    cache: dict = {}

    def score(label: str, path: Path, extra: dict) -> None:
        """`fewbits eval FILE`'s reading and scoring, one row into --json."""
        if not cache:
            cache.update(fill_reference_cache(ref, wins, progress=False))
        model, _, _ = api.load_checkpoint(path)
        cmp = compare(model, None, wins, ref_cache=cache, progress=False)
        del model
        lay = file_layout(path, ref)
        o = cmp["overall"]
        row = {"label": label, "file": str(path), "file_bytes": lay["file_bytes"], "linear_bytes": lay["linear_bytes"],
               "linear_bpw": 8 * lay["linear_bytes"] / lay["linear_weights"], "linear_types": lay["linear_types"],
               "embedding_type": lay["embedding_type"], "kl_mean": o["kl_mean"], "top1": o["top1"],
               "kl": {c: s["kl_mean"] for c, s in cmp["categories"].items()}, **extra}
        out["rows"].append(row)
        save()
        print(json.dumps(row), flush=True)

    with source_gguf(args.model) as src_vocab:
        vocab = None if is_byte_level_bpe(tok) else src_vocab
        f16 = work / "bf16.gguf"
        if not f16.exists():
            m16, _ = load_model(args.model, dtype="bf16")
            export_gguf(m16, f16, tok, pre=pre, vocab_from=vocab)
            del m16
        for ftype in LLAMA_TYPES:
            dst = work / f"llama-{ftype}.gguf"
            if not dst.exists():
                llama_quantize(args.llama_python, f16, dst, ftype, args.threads)
        q4km = file_layout(work / "llama-Q4_K_M.gguf", ref)
        by_gguf = {t.gguf_name: t.name for t in GGML_TYPES.values()}
        emb = by_gguf[q4km["embedding_type"]]
        out["embedding"] = emb
        out["q4_k_m"] = q4km
        bpw = 8 * q4km["linear_bytes"] / q4km["linear_weights"]
        print(f"{args.model}: llama.cpp's Q4_K_M keeps the embedding in {q4km['embedding_type']}; its linear layers "
              f"{q4km['linear_types']} {q4km['linear_bytes']:,} bytes ({bpw:.4f} bits/weight)", flush=True)
        for ftype in LLAMA_TYPES:
            if f"llama.cpp {ftype}" not in done:
                score(f"llama.cpp {ftype}", work / f"llama-{ftype}.gguf",
                      {"method": "llama.cpp", "made_by": "llama_model_quantize"})
        data = calibration_ids(tok, args.calib_len, args.calib_windows)
        fewbits_rows = {"rtn": ("fewbits RTN int4-g32", "int4-g32", "rtn"),
                        "gptq": ("fewbits GPTQ int4-g32", "int4-g32", "gptq"),
                        "awq": ("fewbits AWQ+GPTQ int4-g32", "int4-g32", "awq+gptq"),
                        "gptq5": ("fewbits GPTQ int5-g32", "int5-g32", "gptq"),
                        "mix": (f"fewbits GPTQ mix at Q4_K_M's bytes ({bpw:.3f} bpw)", "budget", "gptq")}
        for key in args.rows.split(","):
            label, fmt, method = fewbits_rows[key]
            if label in done:
                continue
            path = work / (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") + ".gguf")
            side = path.with_suffix(".json")  # the row's figures from quantising, kept beside the file
            if path.exists() and side.exists():
                score(label, path, json.loads(side.read_text()))
                continue
            m, _ = load_model(args.model, dtype="fp32")
            t0 = time.perf_counter()
            extra: dict = {"method": method}
            if fmt == "budget":
                from fewbits.budgeted import budget_recipe

                # bpw exactly at Q4_K_M's linear bytes: the knapsack keeps the pick at or below them
                sens_data = data[:args.sens_windows] if args.sens_windows else data
                mix = budget_recipe(m, sens_data, f"bpw={bpw}", CANDIDATES, method, truth_windows=args.truth_windows)
                recipe = mix.recipe
                extra.update(counts=mix.counts(), proxy_kl=mix.proxy_kl, candidates=list(CANDIDATES),
                             truth_windows=args.truth_windows, sens_calib=list(sens_data.shape))
            else:
                recipe = api.Recipe.from_format(fmt, method)
            api.quantize(m, recipe, data=None if method == "rtn" else data, progress=False, chooser="cached")
            extra["seconds"] = time.perf_counter() - t0
            export_gguf(m, path, tok, pre=pre, vocab_from=vocab, embedding=emb)
            side.write_text(json.dumps(extra))
            del m
            score(label, path, extra)
    save()


if __name__ == "__main__":
    main()
