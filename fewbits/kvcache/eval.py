"""How much a quantised KV cache changes the model: KL against the 16-bit cache at long context.

Protocol (`kv_cache_kl`): one sequence of `prefix + n_eval` tokens.  For each KV format, the first
`prefix` tokens are prefilled into a fresh cache (written, i.e. quantised, as usual), then the next
`n_eval` tokens are fed in chunks of `chunk` tokens, teacher-forced, so every evaluated position attends
to a long quantised history.  The logits at those positions are compared with the same run on the
16-bit (bf16) cache: mean KL(ref || q) per token over the full vocabulary, its 99th percentile, top-1
agreement, and the perplexity of both on the evaluated tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fewbits.eval.metrics import kl_per_token, log_probs, token_nll, top1_agree
from fewbits.kernels.wide16 import widening
from fewbits.kvcache.format import KVFormat, parse_kv_format
from fewbits.kvcache.hf import cache_for, cache_kwargs


@torch.no_grad()
@widening
def continuation_logits(model: torch.nn.Module, ids: torch.Tensor, kv: KVFormat | str, prefix: int,
                        chunk: int = 16) -> torch.Tensor:
    """Logits (n_eval, V) predicting ids[prefix : ] with the cache in format `kv`; ids (1, T)."""
    T = ids.shape[1]
    cache = cache_for(model, kv, T)
    kw = cache_kwargs(model, cache)
    out = model(input_ids=ids[:, :prefix], **kw, use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1:].float()]  # predicts ids[prefix]
    for s in range(prefix, T - 1, chunk):
        e = min(s + chunk, T - 1)
        out = model(input_ids=ids[:, s:e], **kw, use_cache=True)
        logits.append(out.logits[0].float())  # predict ids[s+1 : e+1]
    return torch.cat(logits, 0)  # (T - prefix, V)


def kv_cache_kl(model: torch.nn.Module, ids: torch.Tensor, formats: tuple[str, ...] | list[str], prefix: int = 2048,
                chunk: int = 16, ref: str = "bf16") -> dict[str, dict[str, Any]]:
    """Per KV format: mean and p99 KL vs the `ref` cache, top-1 agreement, perplexities, cache bytes."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[0] != 1 or not 0 < prefix < ids.shape[1] - 1:
        raise ValueError(f"need one sequence longer than prefix + 1 = {prefix + 1} tokens, got ids {tuple(ids.shape)}")
    targets = ids[0, prefix:]
    ref_logp = log_probs(continuation_logits(model, ids, ref, prefix, chunk))
    ref_nll = token_nll(ref_logp, targets)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    results: dict[str, dict[str, Any]] = {}
    for spec in formats:
        f = parse_kv_format(spec)
        q_logp = ref_logp if f.spec == parse_kv_format(ref).spec else log_probs(
            continuation_logits(model, ids, f, prefix, chunk))
        kl = kl_per_token(ref_logp, q_logp)
        nll = token_nll(q_logp, targets)
        results[f.spec] = {
            "context": int(ids.shape[1]), "prefix": prefix, "n_eval": int(targets.numel()),
            "mean_kl": float(kl.mean()), "p99_kl": float(torch.quantile(kl, 0.99)),
            "top1_agree": float(top1_agree(ref_logp, q_logp).float().mean()),
            "ppl": math.exp(float(nll.mean())), "ref_ppl": math.exp(float(ref_nll.mean())),
            "bytes_per_token": f.bytes_per_token(int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), head_dim),
        }
    return results
