"""A library call changes no process-wide state: thread counts, random generators, backend precision flags
and process groups are the same after `api.quantize` as before (house rule 2; the CLI may set them)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch


def process_state() -> dict:
    """Everything process-wide a quantisation could touch, as comparable values."""
    mkl = torch.backends.mkldnn
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        # float32 precision flags, read through the current API only (reading the legacy allow_tf32 /
        # get_float32_matmul_precision after a new-API write raises in torch >= 2.9)
        "fp32_precision": torch.backends.fp32_precision,
        "mkldnn_fp32": mkl.fp32_precision,
        "mkldnn_matmul_fp32": mkl.matmul.fp32_precision,
        "mkldnn_conv_fp32": mkl.conv.fp32_precision,
        "mkldnn_enabled": mkl.enabled,
        "cuda_matmul_fp32": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_fp32": torch.backends.cudnn.fp32_precision,
        "cudnn_conv_fp32": torch.backends.cudnn.conv.fp32_precision,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
    }


def assert_same(before: dict, after: dict) -> None:
    for k, v in before.items():
        same = torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else (
            np.array_equal(v, after[k]) if isinstance(v, np.ndarray) else v == after[k])
        assert same, f"{k} changed: {v!r} -> {after[k]!r}"


@pytest.fixture
def random_llama(tmp_path):
    from fewbits.models.loading import random_model

    cfg = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return lambda: random_model(tmp_path, dtype="fp32")


@pytest.mark.parametrize("method, spec", [("rtn", "int4-g32"), ("gptq", "int4-g32"), ("awq+gptq", "int4-g32"),
                                          ("smoothquant", "int8")])
def test_quantize_leaves_process_state_as_it_was(random_llama, method, spec):
    from fewbits import api

    model = random_llama()
    data = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(2)  # not the default and not 1: a call that pins one thread (or restores the
    # machine's default) shows
    try:
        before = process_state()
        api.quantize(model, spec, method=method, data=data, progress=False, chooser="auto")
        with torch.no_grad():
            model(input_ids=data[:1])
        assert_same(before, process_state())
    finally:
        torch.set_num_threads(1)


def test_the_state_check_sees_a_change():
    """The comparison itself can fail: a seeded generator and a flag flipped inside are caught."""
    before = process_state()
    torch.manual_seed(1234)
    with pytest.raises(AssertionError, match="torch_rng changed"):
        assert_same(before, process_state())
    torch.set_rng_state(before["torch_rng"])
    old = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if old != "bf16" else "none"
    try:
        with pytest.raises(AssertionError, match="mkldnn_matmul_fp32 changed"):
            assert_same(before, process_state())
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old
    assert_same(before, process_state())


def test_quantize_under_a_torchrun_environment_starts_no_process_group(random_llama, monkeypatch):
    """Joining torchrun's process group is the CLI's act (`fewbits quantize`), never the library's."""
    from fewbits import api
    from fewbits.calib import distributed

    def refuse() -> bool:
        raise AssertionError("a library call tried to start a process group")

    monkeypatch.setattr(distributed, "init_from_env", refuse)
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))
    api.quantize(random_llama(), "int4-g32", method="gptq", data=data, progress=False, chooser="reference")
    assert not torch.distributed.is_initialized()
