"""fewbits' llama.cpp block types against llama.cpp itself, and llama.cpp's own files scored by `fewbits eval`.

    python benchmarks/gguf_kquants.py --llama-python /tmp/llv/bin/python [--model smollm2-135m] [--tokens 256]

1. Bytes: llama.cpp quantises fewbits' 16-bit GGUF export to Q4_K_M (its own type mix: Q4_K, Q6_K, and
   Q5_0 / Q8_0 where a row is not whole 256-blocks); fewbits' round-to-nearest quantises every tensor of
   that file again from the same 16-bit values into the same type (`fewbits.formats.ggml.quantize`);
   printed: tensors and blocks byte-identical, per type.
2. Engines: fewbits' RTN export of the same mix (the recipe read from llama.cpp's file) evaluated by
   llama.cpp token by token (its kernels, batch 1) against the same file dequantised (transformers / gguf-py,
   float32): KL per token between the two engines on one file.
3. Quality per bit (`fewbits eval`'s protocol: packaged evaluation texts, KL against the 16-bit model):
   llama.cpp's Q4_0, Q4_K_M and IQ4_NL files (imported through `fewbits.api.load_checkpoint`), beside
   fewbits RTN and GPTQ int4-g32 (written as Q4_0) and the RTN Q4_K_M mix; bits per weight of the linear
   layers and file bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np


def _llama_quantize(llama_python: str, src: Path, dst: Path, ftype: str) -> None:
    code = ("import ctypes, llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
            f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{ftype}; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    subprocess.run([llama_python, "-c", code, str(src), str(dst)], check=True, capture_output=True)


def _tensors(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


def byte_check(src: Path, q: Path) -> tuple[list, dict]:
    """Per tensor of llama.cpp's file q: fewbits' RTN of src's values in the same type, byte for byte."""
    import torch
    from gguf import dequantize

    from fewbits.formats import ggml
    from fewbits.formats.format import parse_format
    from fewbits.formats.ggml_types import GGML_TYPES

    by_gguf = {t.gguf_name: t.name for t in GGML_TYPES.values()}
    a, b = _tensors(src), _tensors(q)
    per_type: dict[str, list[int]] = {}
    rows = []
    for name, t in b.items():
        spec = by_gguf.get(t.tensor_type.name)
        if spec is None:
            continue
        x = torch.from_numpy(dequantize(a[name].data, a[name].tensor_type).astype(np.float32))
        x = x.reshape(-1, x.shape[-1])
        fmt = parse_format(spec)
        codes, header = ggml.quantize(x, fmt)
        mine = ggml.to_gguf_blocks(codes, header, fmt).reshape(-1, GGML_TYPES[spec].block_bytes)
        theirs = torch.from_numpy(np.array(t.data)).reshape(-1, GGML_TYPES[spec].block_bytes)
        same = (mine == theirs).all(-1)
        acc = per_type.setdefault(t.tensor_type.name, [0, 0, 0, 0])
        acc[0] += int(same.all())
        acc[1] += 1
        acc[2] += int(same.sum())
        acc[3] += same.numel()
        rows.append((name, t.tensor_type.name, bool(same.all()), int(same.sum()), same.numel()))
    return rows, per_type


def recipe_from_file(q: Path, model) -> tuple[object, Counter]:  # noqa: ANN001
    """A fewbits recipe giving every linear layer the type llama.cpp's file gives its tensor."""
    from fewbits.export.gguf import _gguf_name, gguf_arch
    from fewbits.formats.ggml_types import GGML_TYPES
    from fewbits.models.recipe import Recipe, Rule

    arch = gguf_arch(model)
    by_gguf = {t.gguf_name: t.name for t in GGML_TYPES.values()}
    types = {n: t.tensor_type.name for n, t in _tensors(q).items()}
    rules, counts = [], Counter()
    for name, mod in model.named_modules():
        if type(mod).__name__ != "Linear" or name == "lm_head":
            continue
        spec = by_gguf[types[_gguf_name(arch, f"{name}.weight")]]
        rules.append(Rule(f"^{re.escape(name)}$", spec))
        counts[spec] += 1
    return Recipe(rules=tuple(rules)), counts


def worker(path: str, ids_file: str, out: str, threads: int) -> None:
    """(llama-cpp-python venv) log-probabilities of every window's tokens, token by token -> out (.npz)."""
    from llama_cpp import Llama

    windows = json.loads(Path(ids_file).read_text())
    llm = Llama(model_path=path, n_ctx=max(len(w) for w in windows.values()) + 8, n_threads=threads,
                n_batch=1, n_ubatch=1, logits_all=True, verbose=False)
    res = {}
    for cat, ids in windows.items():
        llm.reset()
        llm.eval(ids)
        s = np.array(llm.scores[:len(ids)], dtype=np.float64)
        s = s - s.max(-1, keepdims=True)
        res[cat] = s - np.log(np.exp(s).sum(-1, keepdims=True))
    np.savez(out, **res)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--llama-worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per category for the engine comparison")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", type=int, default=2, help="evaluation windows of 512 tokens per category")
    ap.add_argument("--skip-gptq", action="store_true")
    args = ap.parse_args()

    import torch

    from fewbits import api
    from fewbits.cli.quantize import calibration_ids
    from fewbits.data.texts import load_texts
    from fewbits.eval import run
    from fewbits.eval.perplexity import compare
    from fewbits.export.gguf import export_gguf
    from fewbits.export.gguf_vocab import is_byte_level_bpe
    from fewbits.models.loading import load_model
    from fewbits.models.packaged import gguf_tokenizer_pre, source_gguf

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="gguf-kquants-"))
    pre = gguf_tokenizer_pre(args.model)
    with source_gguf(args.model) as src_vocab:
        ref16, tok = load_model(args.model, dtype="bf16")
        vocab = None if is_byte_level_bpe(tok) else src_vocab

        def export(m, name: str) -> Path:  # noqa: ANN001
            return export_gguf(m, tmp / name, tok, pre=pre, vocab_from=vocab)

        f16 = export(ref16, "bf16.gguf")
        files = {}
        for ftype in ("Q4_0", "Q4_K_M", "IQ4_NL"):
            files[f"llama.cpp {ftype}"] = tmp / f"llama-{ftype}.gguf"
            _llama_quantize(args.llama_python, f16, files[f"llama.cpp {ftype}"], ftype)
        # 1. bytes
        rows, per_type = byte_check(f16, files["llama.cpp Q4_K_M"])
        print(f"{args.model}: fewbits RTN vs llama.cpp's Q4_K_M quantiser, tensor by tensor from the same bf16 values")
        for k, (t_same, t_all, b_same, b_all) in per_type.items():
            print(f"  {k:5}: {t_same}/{t_all} tensors byte-identical, {b_same}/{b_all} blocks")
        for name, kind, ok, bs, ba in rows:
            if not ok:
                print(f"    differs: {name} {kind} {ba - bs} of {ba} blocks")
        # fewbits files
        m, _ = load_model(args.model, dtype="bf16")
        recipe, counts = recipe_from_file(files["llama.cpp Q4_K_M"], m)
        api.quantize(m, recipe, progress=False, chooser="cached")
        files["fewbits RTN, Q4_K_M's mix"] = export(m, "fewbits-q4km-mix.gguf")
        del m
        for label, method in (("fewbits RTN int4-g32", "rtn"), ("fewbits GPTQ int4-g32", "gptq")):
            if method == "gptq" and args.skip_gptq:
                continue
            m, _ = load_model(args.model, dtype="bf16")
            data = calibration_ids(tok, 512, 32) if method == "gptq" else None
            api.quantize(m, api.Recipe.from_format("int4-g32", method), data=data, progress=False, chooser="cached")
            files[label] = export(m, f"fewbits-{method}-int4g32.gguf")
            del m
        # 2. engines: llama.cpp token by token against the dequantised file
        texts = load_texts("eval", max_chars=8 * args.tokens)
        win_ids = {c: tok(t).input_ids[:args.tokens] for c, t in texts.items()}
        (tmp / "ids.json").write_text(json.dumps(win_ids))
        print(f"\nllama.cpp (batch 1, {args.threads} threads) against the same file dequantised (float32), "
              f"{len(win_ids)} x {args.tokens} tokens: KL(dequantised || llama.cpp) per token")
        for label in ("fewbits RTN, Q4_K_M's mix", "llama.cpp Q4_K_M"):
            path = files[label]
            subprocess.run([args.llama_python, __file__, "--llama-worker", str(path), str(tmp / "ids.json"),
                            str(tmp / "lp.npz"), str(args.threads)], check=True, capture_output=True)
            lp = dict(np.load(tmp / "lp.npz"))
            model, _, _ = api.load_checkpoint(path)
            kls = []
            with torch.no_grad():
                for c, ids in win_ids.items():
                    ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
                    kls.append((np.exp(ref) * (ref - lp[c])).sum(-1))
            kl = np.concatenate(kls)
            print(f"  {label:28} KL mean {kl.mean():.2e}  max {kl.max():.2e}")
            del model
        # 3. quality per bit, fewbits eval's protocol
        ref32, _ = load_model(args.model, dtype="fp32")
        wins, protocol = run.causal_windows(tok, load_texts("eval"), 512, args.windows)
        print(f"\n{protocol.text()}\nreference: {args.model} (fp32); mix of Q4_K_M: {dict(counts)}")
        print(f"{'file':30} {'linear bpw':>10} {'file MB':>8} {'KL mean':>8} {'top-1':>6}")
        for label, path in files.items():
            model, _, info = api.load_checkpoint(path)
            cmp = compare(model, ref32, wins, progress=False)
            o = cmp["overall"]
            print(f"{label:30} {info['bits_per_weight']:10.3f} {info['size_bytes'] / 1e6:8.1f} "
                  f"{o['kl_mean']:8.4f} {o['top1']:6.3f}")
            del model
    print(f"(files in {tmp})")


if __name__ == "__main__":
    main()
