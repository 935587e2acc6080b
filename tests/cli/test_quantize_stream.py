"""`fewbits quantize DIR --stream` (and the automatic choice): the same output as the in-memory api."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fewbits import api
from fewbits.cli import main


@pytest.fixture
def sharded(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).eval().to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size="60KB")
    return tmp_path / "src"


def _reference(src, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    api.quantize(model, "int4-g32", progress=False, chooser="reference")
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["--stream", "auto"])
def test_stream_writes_what_the_api_computes(sharded, tmp_path, monkeypatch, how):
    import fewbits.stream

    if how == "auto":  # a machine where the model would take more than half the memory available
        monkeypatch.setattr(fewbits.stream, "available_memory", lambda: 100_000)
    out = tmp_path / "out"
    args = ["quantize", str(sharded), "--format", "int4-g32", "--dtype", "bf16", "-o", str(out), "--quiet"]
    r = CliRunner().invoke(main, args + ([how] if how != "auto" else []))
    assert r.exit_code == 0, r.output
    assert ("block by block" in r.output) == (how == "auto")
    got = load_file(out / "model.safetensors")
    want = _reference(sharded, tmp_path)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    meta = json.loads((out / "fewbits.json").read_text())
    assert meta["source"] == str(sharded) and meta["dtype"] == "bfloat16"
    api.load_quantized_model(out)


def test_stream_refusals(sharded, tmp_path):
    out = str(tmp_path / "out")
    r = CliRunner().invoke(main, ["quantize", str(sharded), "--format", "q4_0", "--to", "gguf", "--stream", "-o", out])
    assert r.exit_code != 0 and "--stream writes fewbits' own layout" in r.output
    r = CliRunner().invoke(main, ["quantize", str(sharded), "--format", "int4-g32", "--method", "gptq", "--stream",
                                  "-o", out])
    assert r.exit_code != 0 and "has no tokenizer" in r.output
    assert not (tmp_path / "out").exists()
