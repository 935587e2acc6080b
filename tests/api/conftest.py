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


# ---------------------------------------------------------------------- the packaged SmolLM2-135M
#: evaluation budget of the real-model tests: one window of SEQ tokens per packaged text category
SEQ = 256


@pytest.fixture(scope="session")
def smol_windows(smollm2):
    """(windows, reference log-prob cache) of the float32 SmolLM2 on the packaged evaluation texts."""
    from fewbits.data.texts import load_texts
    from fewbits.eval.perplexity import fill_reference_cache, make_windows

    model, tok = smollm2
    wins, protocol = make_windows(tok, load_texts("eval", max_chars=20_000), seq_len=SEQ, n_windows=1)
    return wins, fill_reference_cache(model, wins, progress=False), protocol


@pytest.fixture(scope="session")
def smol_quantized(smollm2):
    """spec -> (model, report): a copy of the float32 SmolLM2 quantised with RTN, kept for the session."""
    import copy

    from fewbits import api

    done: dict = {}

    def get(spec: str, keep: bool = True):
        """keep=False: do not hold the model for later tests (each copy is about 1 GB with its dense cache)."""
        if spec in done:
            return done[spec]
        model = copy.deepcopy(smollm2[0])
        report = api.quantize(model, spec, progress=False, chooser=api.kernel_chooser("cached"))
        if keep:
            done[spec] = (model, report)
        return model, report

    return get
