"""Encoder quality: cosine similarity of mean-pooled sentence embeddings to the unquantised model.

Sentence embedding = mean of the last hidden states over the sentence's real tokens (attention mask),
as sentence-transformers' all-MiniLM-L6-v2 pools them (before its L2 normalisation, which does not
change the cosine).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from fewbits.kernels.wide16 import widened


def split_sentences(text: str, n: int = 64, min_words: int = 5, max_words: int = 60) -> list[str]:
    """Up to `n` sentences of `min_words`..`max_words` words from `text`, in order."""
    pieces = re.split(r"(?<=[.!?;:])\s+|\n\s*\n", text)
    out: list[str] = []
    for p in pieces:
        s = " ".join(p.split())
        if min_words <= len(s.split()) <= max_words:
            out.append(s)
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"no sentence of {min_words}..{max_words} words in the given text ({len(text)} characters)")
    return out


def sentence_embeddings(model: torch.nn.Module, tokenizer: Any, sentences: Sequence[str], batch: int = 16,
                        max_length: int = 128) -> torch.Tensor:
    """Mean-pooled last hidden states, float32. -> (n_sentences, hidden)."""
    outs = []
    for i in range(0, len(sentences), batch):
        enc = tokenizer(list(sentences[i:i + batch]), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        with torch.inference_mode(), widened():
            h = model(**enc).last_hidden_state.float()  # (B, T, H)
        m = enc["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        outs.append((h * m).sum(1) / m.sum(1).clamp_min(1.0))
    return torch.cat(outs)


def cosine_per_sentence(model: torch.nn.Module, ref: torch.nn.Module, tokenizer: Any,
                        sentences: Sequence[str]) -> torch.Tensor:
    """Cosine similarity of each sentence's embedding under `model` to that under `ref`. -> (n,) float64."""
    a = sentence_embeddings(model, tokenizer, sentences)
    b = sentence_embeddings(ref, tokenizer, sentences)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).double()


def cosine_summary(cos: torch.Tensor) -> dict[str, Any]:
    return {"sentences": int(cos.numel()), "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
            "cos_p01": float(torch.quantile(cos, 0.01))}


def encoder_cosine(model: torch.nn.Module, ref: torch.nn.Module, tokenizer: Any,
                   sentences: Sequence[str]) -> dict[str, Any]:
    """Mean, minimum and 1st percentile of the per-sentence cosine to the reference embeddings."""
    return cosine_summary(cosine_per_sentence(model, ref, tokenizer, sentences))
