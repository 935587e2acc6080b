"""Perplexity and comparison against the reference model on fixed token windows.

Protocol (printed with every result by `protocol_text`): the text of each category is cut into
non-overlapping windows of `seq_len` tokens (a BOS token first in each window where the model
expects one); every window is scored independently (no carried context); perplexity is
exp(mean negative log-likelihood) over every predicted token (L-1 per window of L tokens).

The comparison runs the reference and the quantised model on the same windows and compares their
next-token distributions at every predicted position.  Reference log-probabilities are computed once
per window; pass a dict as `ref_cache` to reuse them across several quantised models (one window of
SmolLM2 is 511 x 49152 float32 = 100 MB, so only a small evaluation budget should be cached).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fewbits.eval.metrics import Accumulated, kl_per_token, log_probs, token_nll, top1_agree
from fewbits.kernels.wide16 import widened


@dataclass(frozen=True)
class Window:
    """One evaluation window: token ids (L,) from text `category`, `index`-th window of that text."""

    category: str
    index: int
    ids: torch.Tensor

    @property
    def key(self) -> tuple[str, int]:
        return (self.category, self.index)


@dataclass(frozen=True)
class Protocol:
    seq_len: int
    bos: bool
    windows_per_category: Mapping[str, int]

    def text(self) -> str:
        n = sum(self.windows_per_category.values())
        cats = ", ".join(f"{c} {k}" for c, k in self.windows_per_category.items())
        return (f"protocol: {n} non-overlapping windows of {self.seq_len} tokens ({cats}); "
                f"{'BOS token first in each window' if self.bos else 'no BOS token'}; each window scored alone; "
                f"ppl = exp(mean NLL over {self.seq_len - 1} predicted tokens per window); "
                f"KL(ref || quant) per token over the full vocabulary")

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "bos": self.bos, "windows": dict(self.windows_per_category)}


#: windows taken from a streamed text file when "all" are asked for (`make_windows(n_windows=None)`)
MAX_STREAM_WINDOWS = 1024


def make_windows(tokenizer: Any, texts: Mapping[str, str | Path], seq_len: int = 512, n_windows: int | None = None,
                 add_bos: bool | None = None) -> tuple[list[Window], Protocol]:
    """Cut each category's text into windows with `fewbits.data.tokens.token_windows` (BOS first in each
    window when the tokenizer puts one before text, unless `add_bos` says otherwise).

    A category given as a Path (a user file) is read and tokenised in pieces only until its windows are
    full (`stream_token_windows`), so a file of any size takes the same memory; "all windows"
    (n_windows None) of a file means at most MAX_STREAM_WINDOWS."""
    from fewbits.data.textfile import stream_text
    from fewbits.data.tokens import stream_token_windows, token_windows, wants_bos

    bos = wants_bos(tokenizer) if add_bos is None else add_bos
    windows: list[Window] = []
    counts: dict[str, int] = {}
    for cat, text in texts.items():
        if isinstance(text, Path):
            try:
                ids = stream_token_windows(tokenizer, stream_text(text), seq_len, n_windows or MAX_STREAM_WINDOWS,
                                           add_bos=bos)  # (n, seq_len)
            except ValueError as e:
                raise ValueError(f"text category {cat!r} ({text}): {e}") from None
        else:
            if not text or not text.strip():
                raise ValueError(f"text category {cat!r} is empty; nothing to evaluate")
            try:
                ids = token_windows(tokenizer, text, seq_len, n_windows=n_windows, add_bos=bos)  # (n, seq_len)
            except ValueError as e:
                raise ValueError(f"text category {cat!r}: {e}") from None
        counts[cat] = int(ids.shape[0])
        windows += [Window(cat, i, row.clone()) for i, row in enumerate(ids)]
    return windows, Protocol(seq_len, bos, counts)


def model_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, V) of a causal LM for token ids (B, L), without computing a loss."""
    with torch.inference_mode(), widened():
        out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def _batches(windows: Sequence[Window], batch: int) -> Iterable[list[Window]]:
    for i in range(0, len(windows), batch):
        yield list(windows[i:i + batch])


def perplexity(model: torch.nn.Module, windows: Sequence[Window], batch: int = 2,
               progress: bool = True, desc: str = "perplexity") -> dict[str, Any]:
    """{"overall": summary, "categories": {cat: summary}} with ppl/nll/tokens per summary."""
    acc: dict[str, Accumulated] = {}
    overall = Accumulated()
    for group in tqdm(list(_batches(windows, batch)), desc=desc, disable=not progress, leave=False):
        logits = model_logits(model, torch.stack([w.ids for w in group]))
        for w, z in zip(group, logits, strict=True):
            nll = token_nll(log_probs(z[:-1]), w.ids[1:])
            acc.setdefault(w.category, Accumulated()).add(nll)
            overall.add(nll)
    return {"overall": overall.summary(), "categories": {c: a.summary() for c, a in acc.items()}}


def reference_perplexity(windows: Sequence[Window], ref_cache: dict[tuple[str, int], torch.Tensor]
                         ) -> dict[str, Any]:
    """`perplexity` of the reference model from its cached log-probs (no forward pass)."""
    acc: dict[str, Accumulated] = {}
    overall = Accumulated()
    for w in windows:
        nll = token_nll(ref_cache[w.key], w.ids[1:])
        acc.setdefault(w.category, Accumulated()).add(nll)
        overall.add(nll)
    return {"overall": overall.summary(), "categories": {c: a.summary() for c, a in acc.items()}}


def compare(model: torch.nn.Module, ref: torch.nn.Module | None, windows: Sequence[Window], batch: int = 2,
            ref_cache: dict[tuple[str, int], torch.Tensor] | None = None, progress: bool = True,
            desc: str = "compare") -> dict[str, Any]:
    """Quantised `model` against `ref` on the same windows: perplexity of both, delta, KL mean and
    99th percentile, top-1 agreement; overall and per category.  `ref` may be None when every
    window's reference log-probs are already in `ref_cache`."""
    acc: dict[str, Accumulated] = {}
    overall = Accumulated()
    for group in tqdm(list(_batches(windows, batch)), desc=desc, disable=not progress, leave=False):
        ref_lp = _reference(ref, group, ref_cache)
        logits = model_logits(model, torch.stack([w.ids for w in group]))
        for w, z, rlp in zip(group, logits, ref_lp, strict=True):
            qlp = log_probs(z[:-1])  # (L-1, V)
            targets = w.ids[1:]
            nll, ref_nll = token_nll(qlp, targets), token_nll(rlp, targets)
            kl, agree = kl_per_token(rlp, qlp), top1_agree(rlp, qlp)
            acc.setdefault(w.category, Accumulated()).add(nll, ref_nll, kl, agree)
            overall.add(nll, ref_nll, kl, agree)
            del qlp
    return {"overall": overall.summary(), "categories": {c: a.summary() for c, a in acc.items()}}


def _reference(ref: torch.nn.Module | None, group: list[Window],
               cache: dict[tuple[str, int], torch.Tensor] | None) -> list[torch.Tensor]:
    """Reference log-probs (L-1, V) per window, from the cache where present."""
    missing = [w for w in group if cache is None or w.key not in cache]
    fresh: dict[tuple[str, int], torch.Tensor] = {}
    if missing:
        if ref is None:
            raise ValueError(f"no reference model and no cached reference for windows {[w.key for w in missing]}")
        logits = model_logits(ref, torch.stack([w.ids for w in missing]))
        for w, z in zip(missing, logits, strict=True):
            fresh[w.key] = log_probs(z[:-1])
        if cache is not None:
            cache.update(fresh)
    return [fresh[w.key] if w.key in fresh else cache[w.key] for w in group]  # type: ignore[index]


def fill_reference_cache(ref: torch.nn.Module, windows: Sequence[Window], batch: int = 2,
                         progress: bool = True) -> dict[tuple[str, int], torch.Tensor]:
    """Reference log-probs of every window, to share between several `compare` calls."""
    cache: dict[tuple[str, int], torch.Tensor] = {}
    for group in tqdm(list(_batches(windows, batch)), desc="reference", disable=not progress, leave=False):
        _reference(ref, group, cache)
    return cache

