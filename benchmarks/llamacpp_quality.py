"""Quality of GGUF files as llama.cpp computes them, beside the same files dequantised (transformers, fp32).

    python benchmarks/llamacpp_quality.py --llama-python /tmp/llcpp/bin/python [--tokens 512] [--threads 2]

Files (SmolLM2-135M): fewbits' GGUF exports (`fewbits.export.gguf`) of the bf16 model (the reference),
int4-g32 RTN as Q4_0 and int8-g32 RTN as Q8_0; the packaged Q4_1 file as shipped (its weights are the
bf16 model's: fewbits' model is converted from it); and llama.cpp's own Q4_0 of the bf16 file
(`llama_model_quantize`).  Each is scored on the packaged evaluation texts (verse, prose, code: the first
--tokens tokens of each) three times: from llama.cpp's logits (its kernels, through llama-cpp-python in its
own venv, see compare_llamacpp.py for building it) with the window evaluated as one batch ("b512", as a
prompt is) and token by token ("b1", as decode steps run), and from transformers' GGUF loader (weights
dequantised, fp32 matmuls).  Printed: perplexity and KL(bf16 || file) per token, each engine against its
own bf16 run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def _log_softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def worker(path: str, ids_file: str, out: str, threads: int, batch: int) -> None:
    """(llama-cpp-python venv) log-probabilities of every window's tokens -> out (.npz), the prompt
    evaluated `batch` tokens at a time (1: token by token, as decode steps run)."""
    from llama_cpp import Llama

    windows = json.loads(Path(ids_file).read_text())
    llm = Llama(model_path=path, n_ctx=max(len(w) for w in windows.values()) + 8, n_threads=threads,
                n_batch=batch, n_ubatch=batch, logits_all=True, verbose=False)
    res = {}
    for cat, ids in windows.items():
        llm.reset()
        llm.eval(ids)
        res[cat] = _log_softmax(np.array(llm.scores[:len(ids)], dtype=np.float64))
    np.savez(out, **res)


def _quantize_q4_0(llama_python: str, src: Path, dst: Path) -> None:
    code = ("import ctypes, llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
            "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    subprocess.run([llama_python, "-c", code, str(src), str(dst)], check=True, capture_output=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from fewbits import api
    from fewbits.data.texts import load_texts
    from fewbits.export.gguf import export_gguf
    from fewbits.models.loading import load_model
    from fewbits.models.packaged import gguf_tokenizer_pre, packaged_entry, source_files

    tmp = Path(tempfile.mkdtemp(prefix="llamacpp-quality-"))
    pre = gguf_tokenizer_pre("smollm2-135m")
    files: dict[str, Path] = {}
    exports = (("bf16", None), ("fewbits int4-g32 (Q4_0)", "int4-g32"), ("fewbits int8-g32 (Q8_0)", "int8-g32"))
    for label, spec in exports:
        m, tok = load_model("smollm2-135m", dtype="bf16")
        if spec:
            api.quantize(m, spec, progress=False, chooser="cached")
        files[label] = export_gguf(m, tmp / f"{spec or 'bf16'}.gguf", tok, pre=pre)
    files["packaged Q4_1 (as shipped)"] = source_files(packaged_entry("smollm2-135m"))[0]
    _quantize_q4_0(args.llama_python, files["bf16"], tmp / "llama-q4_0.gguf")
    files["llama.cpp's own Q4_0"] = tmp / "llama-q4_0.gguf"

    texts = load_texts("eval", max_chars=8 * args.tokens)
    windows = {cat: tok(text).input_ids[:args.tokens] for cat, text in texts.items()}
    (tmp / "ids.json").write_text(json.dumps(windows))
    batches = {f"llama.cpp b{args.tokens}": args.tokens, "llama.cpp b1": 1}
    scores: dict[str, dict[str, dict[str, np.ndarray]]] = {e: {} for e in [*batches, "transformers"]}
    for label, path in files.items():
        for engine, batch in batches.items():
            out = tmp / "lp.npz"
            subprocess.run([args.llama_python, __file__, "--llama-worker", str(path), str(tmp / "ids.json"),
                            str(out), str(args.threads), str(batch)], check=True, capture_output=True)
            scores[engine][label] = dict(np.load(out))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     trust_remote_code=False).eval()
        with torch.no_grad():
            scores["transformers"][label] = {
                cat: torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
                for cat, ids in windows.items()}
        del model
    print(f"SmolLM2-135M, {len(windows)} windows x {args.tokens} tokens ({', '.join(windows)}), "
          f"llama.cpp on {args.threads} threads")
    print(f"{'file':>28} {'engine':>15} {'ppl':>8} {'KL mean':>8}  " + "  ".join(f"{'KL ' + c:>8}" for c in windows))
    for label in files:
        for engine, by_file in scores.items():
            lp, ref = by_file[label], by_file["bf16"]
            nll = [-lp[c][i, ids[i + 1]] for c, ids in windows.items() for i in range(len(ids) - 1)]
            kl = {c: float((np.exp(ref[c]) * (ref[c] - lp[c])).sum(-1)[:-1].mean()) for c in windows}
            print(f"{label:>28} {engine:>15} {np.exp(np.mean(nll)):8.3f} {np.mean(list(kl.values())):8.4f}  "
                  + "  ".join(f"{kl[c]:8.4f}" for c in windows))


if __name__ == "__main__":
    main()
