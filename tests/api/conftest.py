"""Fixtures for the api tests: a tiny random Llama (fast), and the packaged SmolLM2-135M with a small,
fixed evaluation budget shared by every real-model test (loaded once per session)."""

from __future__ import annotations

import pytest
import torch


def make_tiny_llama(seed: int = 0, tie: bool = True, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                      max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny():
    return make_tiny_llama()


@pytest.fixture
def tiny_factory():
    return make_tiny_llama
