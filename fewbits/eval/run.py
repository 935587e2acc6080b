"""Evaluation runs shared by `fewbits eval` and `fewbits demo`: texts -> windows -> result rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fewbits.eval.encoder import cosine_per_sentence, cosine_summary, split_sentences
from fewbits.eval.perplexity import Protocol, Window, make_windows

#: class-name suffixes of models scored by next-token prediction (others are encoders)
CAUSAL_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")


def is_causal_lm(model: torch.nn.Module) -> bool:
    return type(model).__name__.endswith(CAUSAL_SUFFIXES)


def eval_texts(files: Sequence[str] = (), names: Sequence[str] = (), max_chars: int | None = None
               ) -> dict[str, str] | dict[str, Path]:
    """The user's text files (category = `names` or the file stem) as checked paths, read in pieces when
    their windows are cut (memory independent of their size), else the packaged evaluation texts."""
    from fewbits.data import texts as T

    if files:
        return T.texts_from_files(list(files), list(names) or None, stream=True)
    texts = T.load_texts(split="eval", max_chars=max_chars)
    for cat, t in texts.items():
        if not t or not t.strip():
            raise ValueError(f"text category {cat!r} is empty; nothing to evaluate")
    return texts


def causal_windows(tokenizer: Any, texts: Mapping[str, str | Path], seq_len: int, windows: int | None
                   ) -> tuple[list[Window], Protocol]:
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 tokens, got {seq_len}")
    return make_windows(tokenizer, texts, seq_len, windows)


def result_row(method: str, fmt: str, bits_per_weight: float | None, size_bytes: int, ref_size_bytes: int,
               cmp: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {"method": method, "format": fmt, "bits_per_weight": bits_per_weight, "size_bytes": size_bytes,
            "ref_size_bytes": ref_size_bytes, "overall": dict(cmp["overall"]),
            "categories": {c: dict(v) for c, v in cmp["categories"].items()}, **extra}


def compare_encoder(model: torch.nn.Module, ref: torch.nn.Module, tokenizer: Any, texts: Mapping[str, str | Path],
                    per_category: int = 32) -> dict[str, Any]:
    """Cosine of mean-pooled sentence embeddings to the reference, per category and overall."""
    from fewbits.data.textfile import read_prefix

    cats = {c: split_sentences(read_prefix(t) if isinstance(t, Path) else t, per_category) for c, t in texts.items()}
    sentences = [s for ss in cats.values() for s in ss]
    cos = cosine_per_sentence(model, ref, tokenizer, sentences)  # (n,), categories in order
    out, i = {}, 0
    for c, ss in cats.items():
        out[c] = cosine_summary(cos[i:i + len(ss)])
        i += len(ss)
    return {"overall": cosine_summary(cos), "categories": out}


def encoder_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = f"{'method':<8} {'format':<11} {'bits/w':>6} {'size MB':>8} {'cos mean':>9} {'cos min':>8} {'sentences':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        o = r["overall"]
        bpw = "-" if r.get("bits_per_weight") is None else f"{r['bits_per_weight']:.2f}"
        lines.append(f"{r['method']:<8} {r['format']:<11} {bpw:>6} {r['size_bytes'] / 1e6:8.1f} "
                     f"{o['cos_mean']:9.6f} {o['cos_min']:8.5f} {o['sentences']:>9}")
    return "\n".join(lines)
