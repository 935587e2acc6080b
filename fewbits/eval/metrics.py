"""Per-token quality measures over logits, and an accumulator that keeps them per category.

All measures are taken at the positions that predict a token inside the window: for a window of
L tokens, logits[0 : L-1] predict tokens[1 : L].

- negative log-likelihood  nll_t = -log softmax(z_t)[y_{t+1}];  perplexity = exp(mean_t nll_t)
- KL(ref || q) per token over the full vocabulary: sum_v p_ref(v) (log p_ref(v) - log p_q(v))
  (the direction used by llama.cpp's ``--kl-divergence``: the reference distribution weights the error)
- top-1 agreement: argmax_v z_ref == argmax_v z_q
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax in float32 over the last (vocabulary) axis. (T, V) -> (T, V)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position. logp (T, V), targets (T,) -> (T,)."""
    return -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def kl_per_token(ref_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per position, in nats. Both (T, V) log-probabilities -> (T,), clamped at 0."""
    p = ref_logp.exp()
    return (p * (ref_logp - q_logp)).sum(-1).clamp_min(0.0)


def top1_agree(ref_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """True where both distributions put their largest mass on the same token. (T, V) -> (T,) bool."""
    return ref_logp.argmax(-1) == q_logp.argmax(-1)


@dataclass
class Accumulated:
    """Running sums for one category (or overall): NLL of both models, KL values, top-1 hits."""

    nll_sum: float = 0.0
    ref_nll_sum: float = 0.0
    n_tokens: int = 0
    n_windows: int = 0
    kl: list[torch.Tensor] = field(default_factory=list)
    top1_hits: int = 0

    def add(self, nll: torch.Tensor, ref_nll: torch.Tensor | None = None, kl: torch.Tensor | None = None,
            agree: torch.Tensor | None = None) -> None:
        self.nll_sum += float(nll.double().sum())
        self.n_tokens += int(nll.numel())
        self.n_windows += 1
        if ref_nll is not None:
            self.ref_nll_sum += float(ref_nll.double().sum())
        if kl is not None:
            self.kl.append(kl.detach().float().cpu())
        if agree is not None:
            self.top1_hits += int(agree.sum())

    def summary(self) -> dict[str, Any]:
        """Perplexity, and when a reference was given: reference perplexity, delta, KL mean/p99, top-1."""
        n = max(self.n_tokens, 1)
        out: dict[str, Any] = {"windows": self.n_windows, "tokens": self.n_tokens,
                               "ppl": math.exp(self.nll_sum / n), "nll": self.nll_sum / n}
        if self.kl:
            kl = torch.cat(self.kl).double()
            ref_ppl = math.exp(self.ref_nll_sum / n)
            out.update({
                "ref_ppl": ref_ppl,
                "delta_ppl": out["ppl"] - ref_ppl,
                "kl_mean": float(kl.mean()),
                "kl_p99": float(torch.quantile(kl, 0.99)),
                "kl_max": float(kl.max()),
                "top1": self.top1_hits / n,
            })
        return out
