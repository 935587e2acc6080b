"""Built-in model shapes: the fields of each model's published ``config.json`` (pure Python).

Each preset is the subset of config.json fields that `ModelSpec.from_config_dict` reads, copied from
the Hugging Face repository named in "_repo"; the parameter counts follow from them exactly (the
tests compare them with the published counts).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from fewbits.models.spec import ModelSpec, ModelSpecError


def _llama(layers: int, d: int, heads: int, kv: int, mlp: int, vocab: int, repo: str, ctx: int,
           model_type: str = "llama", **extra: Any) -> dict[str, Any]:
    return {"_repo": repo, "model_type": model_type, "num_hidden_layers": layers, "hidden_size": d,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": mlp,
            "vocab_size": vocab, "max_position_embeddings": ctx, **extra}


PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, "meta-llama/Meta-Llama-3-8B", 8192,
                         tie_word_embeddings=False),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, "meta-llama/Meta-Llama-3-70B", 8192,
                          tie_word_embeddings=False),
    "llama-3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, "meta-llama/Llama-3.1-8B", 131072,
                           tie_word_embeddings=False),
    "llama-3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, "meta-llama/Llama-3.1-70B", 131072,
                            tie_word_embeddings=False),
    "llama-3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, "meta-llama/Llama-3.1-405B", 131072,
                             tie_word_embeddings=False),
    "llama-3.2-1b": _llama(16, 2048, 32, 8, 8192, 128256, "meta-llama/Llama-3.2-1B", 131072,
                           head_dim=64, tie_word_embeddings=True),
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000, "meta-llama/Llama-2-7b-hf", 4096,
                         tie_word_embeddings=False),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824, 32000, "meta-llama/Llama-2-13b-hf", 4096,
                          tie_word_embeddings=False),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, "mistralai/Mistral-7B-v0.1", 32768, "mistral",
                         tie_word_embeddings=False),
    "mixtral-8x7b": _llama(32, 4096, 32, 8, 14336, 32000, "mistralai/Mixtral-8x7B-v0.1", 32768, "mixtral",
                           num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2.5-0.5b": _llama(24, 896, 14, 2, 4864, 151936, "Qwen/Qwen2.5-0.5B", 32768, "qwen2",
                           tie_word_embeddings=True),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, "Qwen/Qwen2.5-7B", 131072, "qwen2",
                         tie_word_embeddings=False),
    "qwen2.5-72b": _llama(80, 8192, 64, 8, 29568, 152064, "Qwen/Qwen2.5-72B", 131072, "qwen2",
                          tie_word_embeddings=False),
    "qwen3-0.6b": _llama(28, 1024, 16, 8, 3072, 151936, "Qwen/Qwen3-0.6B", 40960, "qwen3",
                         head_dim=128, tie_word_embeddings=True, attention_bias=False),
    "qwen1.5-moe-a2.7b": _llama(24, 2048, 16, 16, 5632, 151936, "Qwen/Qwen1.5-MoE-A2.7B", 8192, "qwen2_moe",
                                tie_word_embeddings=False, num_experts=60, num_experts_per_tok=4,
                                moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3-30b-a3b": _llama(48, 2048, 32, 4, 6144, 151936, "Qwen/Qwen3-30B-A3B", 40960, "qwen3_moe",
                            head_dim=128, tie_word_embeddings=False, attention_bias=False, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                            mlp_only_layers=[]),
    "gemma-2b": _llama(18, 2048, 8, 1, 16384, 256000, "google/gemma-2b", 8192, "gemma", head_dim=256),
    "gemma-2-9b": _llama(42, 3584, 16, 8, 14336, 256000, "google/gemma-2-9b", 8192, "gemma2", head_dim=256),
    "gemma-3-270m": _llama(18, 640, 4, 1, 2048, 262144, "google/gemma-3-270m", 32768, "gemma3_text",
                           head_dim=256),
    "phi-3-mini": _llama(32, 3072, 32, 32, 8192, 32064, "microsoft/Phi-3-mini-4k-instruct", 4096, "phi3",
                         tie_word_embeddings=False),
    "smollm2-135m": _llama(30, 576, 9, 3, 1536, 49152, "HuggingFaceTB/SmolLM2-135M", 8192,
                           tie_word_embeddings=True),
    "smollm2-360m": _llama(32, 960, 15, 5, 2560, 49152, "HuggingFaceTB/SmolLM2-360M", 8192,
                           tie_word_embeddings=True),
}

#: other spellings users type
ALIASES: dict[str, str] = {
    "llama3-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "llama-3-8b-instruct": "llama-3-8b",
    "llama3-70b": "llama-3-70b", "llama-3.1-405b-instruct": "llama-3.1-405b", "llama2-7b": "llama-2-7b",
    "mistral-7b-v0.1": "mistral-7b", "mixtral": "mixtral-8x7b", "qwen2.5-7b-instruct": "qwen2.5-7b",
    "gemma2-9b": "gemma-2-9b", "smollm2": "smollm2-135m", "gemma3-270m": "gemma-3-270m", "phi3-mini": "phi-3-mini",
}


def preset_names() -> list[str]:
    return sorted(PRESET_CONFIGS)


def preset_config(name: str) -> tuple[str, dict[str, Any]]:
    """(canonical name, Hugging Face config dict) of the built-in model `name` (case-insensitive); an
    unknown name lists the closest ones."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESET_CONFIGS:
        close = difflib.get_close_matches(key, list(PRESET_CONFIGS) + list(ALIASES), n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(dict.fromkeys(ALIASES.get(c, c) for c in close))}? " if close else ""
        raise ModelSpecError(f"unknown model {name!r}; {hint}known: {', '.join(preset_names())} "
                             "(or give the path of a config.json)")
    return key, {k: v for k, v in PRESET_CONFIGS[key].items() if not k.startswith("_")}


def get_preset(name: str) -> ModelSpec:
    """The built-in spec `name` (case-insensitive); an unknown name lists the closest ones."""
    key, cfg = preset_config(name)
    return ModelSpec.from_config_dict(cfg, source=f"preset {key}", name=key)


def resolve_model(model: str | Path | ModelSpec) -> ModelSpec:
    """A ModelSpec, a preset name, or the path of a config.json (or of a folder holding one)."""
    if isinstance(model, ModelSpec):
        return model
    p = Path(model)
    if str(model).endswith(".json") or p.is_dir() or p.is_file():
        return ModelSpec.from_hf_config(p)
    return get_preset(str(model))
