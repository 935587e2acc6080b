"""What the static decode path needs to know about a Hugging Face causal LM, read off its modules.

The step (`fewbits.decode.step`) calls the model's own modules (embedding, norms, projections, MLP,
rotary embedding, LM head), so their numerics are the model's; only the attention and its cache are
fewbits'.  This module says, per layer, what the attention needs: heads, head dim, scaling, the q/k
norms (Qwen3, Gemma-3), a sliding window (Gemma-3, Mistral, Qwen2 with windows), and whether the layer
norms the attention and MLP outputs too (Gemma's sandwich norms).  Anything else is refused with a
one-line reason, and the caller runs the model eagerly instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

#: model types whose decoder the static path reproduces
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
#: rotary embeddings that depend on the position alone (not on the sequence length seen so far)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LayerPlan:
    window: int | None  # sliding window in tokens (a key is seen while query - key < window), or None
    rope_key: str | None  # the rotary embedding's layer type (Gemma-3: local / global bases), or None
    scaling: float


@dataclass(frozen=True)
class Arch:
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    sandwich: bool  # Gemma: norms after attention and around the MLP
    layers: tuple[LayerPlan, ...]
    final_softcap: float | None

    @property
    def rope_keys(self) -> tuple[str | None, ...]:
        return tuple(dict.fromkeys(p.rope_key for p in self.layers))


def _text_config(model: torch.nn.Module):  # noqa: ANN202 - a transformers config
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def unsupported(model: torch.nn.Module) -> str | None:
    """None when the static path can run `model`, else why not (one line)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return f"{type(model).__name__} has no transformers config"
    mt = getattr(_text_config(model), "model_type", None)
    if mt not in SUPPORTED:
        return f"model type {mt!r} is not one the static decode path reproduces ({', '.join(SUPPORTED)})"
    inner = getattr(model, "model", None)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, part):
            return f"{type(model).__name__}.model has no {part}"
    if not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no lm_head"
    if getattr(_text_config(model), "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping is not implemented in the static path"
    rot = inner.rotary_emb
    kinds = [getattr(rot, "rope_type", "default")] + [v for k, v in vars(rot).items() if k.endswith("rope_type")]
    bad = [k for k in kinds if isinstance(k, str) and k not in STATIC_ROPE]
    if bad:
        return f"rotary embedding {bad[0]!r} depends on the sequence length: not a fixed graph"
    return None


def describe(model: torch.nn.Module) -> Arch:
    """The `Arch` of a supported model (`unsupported(model)` is None)."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(why)
    cfg = _text_config(model)
    layers = model.model.layers[: cfg.num_hidden_layers]
    takes_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
    plans = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        if cfg.model_type == "mistral":
            window = getattr(cfg, "sliding_window", None)
        rope_key = None
        if takes_type:
            types = getattr(cfg, "layer_types", None)
            rope_key = types[i] if types else "full_attention"
        plans.append(LayerPlan(int(window) if window else None, rope_key, float(attn.scaling)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Arch(cfg.model_type, len(plans), int(cfg.num_attention_heads), int(cfg.num_key_value_heads),
                int(head_dim), hasattr(layers[0], "pre_feedforward_layernorm"), tuple(plans),
                getattr(cfg, "final_logit_softcapping", None))
