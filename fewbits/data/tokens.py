"""Cutting a text into non-overlapping token windows for perplexity and KL measurements.

Each window is scored on its own, so a model trained to see a BOS token first (Gemma) gets one at the
start of every window: the window then holds BOS + (seq_len - 1) text tokens.  Whether a tokenizer
expects BOS is read from the tokenizer itself: it does when encoding with special tokens puts its
`bos_token_id` first (Hugging Face tokenizers apply the model's ``add_bos_token`` setting there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def wants_bos(tokenizer: Any) -> bool:
    """True when `tokenizer` prepends its BOS token to encoded text (e.g. Gemma; not SmolLM2)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return len(ids) > 0 and ids[0] == bos


def token_windows(tokenizer: Any, text: str, seq_len: int, n_windows: int | None = None,
                  add_bos: bool | None = None) -> torch.Tensor:
    """LongTensor (n, seq_len) of non-overlapping windows of `text`, in order from its start.

    tokenizer: anything with ``encode(text, add_special_tokens=False) -> list[int]`` and
    ``bos_token_id``; add_bos: put BOS first in each window (default: `wants_bos(tokenizer)`);
    n_windows: at most this many windows (default every full window).  The tail shorter than a window is
    dropped.  A text shorter than one window is a ValueError."""
    body, bos = _window_shape(tokenizer, seq_len, n_windows, add_bos)
    n_max = None if n_windows is None else n_windows * body
    ids = _encode(tokenizer, text, n_max)
    return _windows(ids, body, n_windows, bos, len(text))


def stream_token_windows(tokenizer: Any, pieces: Iterable[str], seq_len: int, n_windows: int,
                         add_bos: bool | None = None) -> torch.Tensor:
    """`token_windows` over a text given in pieces (`fewbits.data.textfile.stream_text`), reading and
    tokenising only until `n_windows` windows are full: memory is the windows and one piece, whatever the
    length of the text.  Each piece is tokenised on its own (pieces end at line breaks)."""
    body, bos = _window_shape(tokenizer, seq_len, n_windows, add_bos)
    need = n_windows * body
    ids: list[int] = []
    chars = 0
    for piece in pieces:
        chars += len(piece)
        ids += _encode(tokenizer, piece, need - len(ids))
        if len(ids) >= need:
            break
    return _windows(ids, body, n_windows, bos, chars)


def _window_shape(tokenizer: Any, seq_len: int, n_windows: int | None, add_bos: bool | None) -> tuple[int, int | None]:
    """(text tokens per window, the BOS id put first or None), checking the arguments of both builders."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one predicted token), got {seq_len}")
    if n_windows is not None and n_windows < 1:
        raise ValueError(f"n_windows must be at least 1, got {n_windows}")
    if add_bos is None:
        add_bos = wants_bos(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    return (seq_len - 1, int(bos)) if add_bos else (seq_len, None)


def _windows(ids: list[int], body: int, n_windows: int | None, bos: int | None, chars: int) -> torch.Tensor:
    """Whole windows of `body` text tokens from `ids` (at most `n_windows`), each after `bos` when given."""
    n = len(ids) // body
    if n_windows is not None:
        n = min(n, n_windows)
    if n == 0:
        seq_len = body + (bos is not None)
        raise ValueError(f"text of {chars} characters gives {len(ids)} tokens, fewer than one window of "
                         f"{body} text tokens (seq_len {seq_len}{', BOS first' if bos is not None else ''})")
    out = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)  # (n, body)
    if bos is not None:
        out = torch.cat([torch.full((n, 1), int(bos), dtype=torch.long), out], dim=1)  # (n, seq_len)
    return out


def _encode(tokenizer: Any, text: str, n_max: int | None) -> list[int]:
    """Token ids of `text` without special tokens.  When only `n_max` tokens are needed, a long text is
    encoded in growing prefixes (cut at a line break) so a few windows do not tokenise a whole play."""
    if n_max is None:
        return _encode_all(tokenizer, text)
    chars = max(4096, 8 * n_max)
    while chars < len(text):
        cut = text.rfind("\n", 0, chars)
        prefix = text[: cut if cut > chars // 2 else chars]
        ids = _encode_all(tokenizer, prefix)
        if len(ids) > n_max + 16:  # margin: the last tokens of a prefix may merge differently
            return ids[:n_max]
        chars *= 2
    return _encode_all(tokenizer, text)


def _encode_all(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    except TypeError:  # tokenizers without the `verbose` keyword (long-input warning switch)
        return list(tokenizer.encode(text, add_special_tokens=False))


__all__ = ["token_windows", "stream_token_windows", "wants_bos"]
