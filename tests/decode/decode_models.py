"""Tiny random models of each family the static decode path reproduces (Llama, Qwen2, Qwen3, Gemma-3)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def build(family: str, dtype: torch.dtype = torch.float32, layers: int | None = None) -> torch.nn.Module:
    """A tiny random `family` model; `layers` (Llama only) instead of COMMON's two."""
    torch.manual_seed(0)
    if layers is not None and family != "llama":
        raise ValueError("layers: Llama only")
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": layers or COMMON["num_hidden_layers"]}))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))  # q/k/v biases
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32))  # q/k norms
    elif family == "gemma3":  # sandwich norms, q/k norms, a sliding window shorter than the test's context
        cfg = Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=32, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               query_pre_attn_scalar=32)
        model = Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # transformers initialises Gemma's norm weights to 0 (scale 1): vary them
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


def teacher_forced_logits(model: torch.nn.Module, kv: str, ids: torch.Tensor, new: int,
                          cache_dir: Path) -> list[torch.Tensor]:
    """Logits (B, new, V) of the compiled step, then of the uncompiled one (fp32, on the CPU), both fed the eager
    path's greedy tokens for `new` - 1 steps after the prompt `ids` (the compiled step's time recorded)."""
    from fewbits.decode.runner import StaticDecoder
    from fewbits.generate import generate

    ref = generate(model, ids, new, kv=kv).tokens
    runs = []
    for compiled in (True, False):
        dec = StaticDecoder(model, kv, ids.shape[0], ids.shape[1] + new, compile=compiled, cache_dir=cache_dir)
        logits = [dec.prefill(ids)]
        for i in range(new - 1):
            logits.append(dec.step(ref[:, i]))
        runs.append(torch.stack(logits, 1).float().cpu())
        if compiled:
            assert dec.compile_s > 0
    return runs
