"""Tiny random models (llama and gemma3 layouts) for fast calibration tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn


def make_tiny(family: str = "llama", seed: int = 0, layers: int = 2) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, max_position_embeddings=128, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"] * (layers // 2))
        model = transformers.Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # random norm gains so that folding scales into (1 + w) is really exercised
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    else:
        raise ValueError(family)
    return model.eval()


@pytest.fixture
def tiny() -> Callable[..., nn.Module]:
    return make_tiny


@pytest.fixture
def calib_ids() -> torch.Tensor:
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def eval_ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))


@pytest.fixture(autouse=True)
def _one_thread():
    """The column loop of GPTQ is many small operations; on a shared 2-core machine a second intra-op
    thread only adds waiting.  Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
