"""LazyModel: a weightless skeleton, modules read from the shards on demand and dropped again."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from fewbits.models.lazy import CheckpointIndex, LazyModel
from fewbits.models.loading import ModelLoadError


@pytest.fixture
def sharded(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    return tmp_path / "m", model


def test_reads_match_safetensors(sharded):
    d, _ = sharded
    idx = CheckpointIndex(d)
    name = "model.embed_tokens.weight"
    e = idx.entries[name]
    with safe_open(str(e.file), "pt") as f:
        want = f.get_tensor(name)
        assert torch.equal(idx.read(name), want)
        assert torch.equal(idx.read(name, 5, 9), f.get_slice(name)[5:9])
    pieces = list(idx.rows(name, max_bytes=64 * 2 * 10))  # 10 rows of 64 bf16 values each
    assert [p.shape[0] for p in pieces] == [10] * 25 + [6]
    assert torch.equal(torch.cat(pieces), want)


def test_skeleton_load_and_free(sharded):
    d, ref = sharded
    lazy = LazyModel.open(d, dtype="float32")
    m = lazy.model
    assert all(p.device.type == "meta" for p in m.parameters())
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied as from_pretrained ties it
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert torch.equal(m.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)  # computed, not stored
    assert lazy.source["lm_head.weight"] == "model.embed_tokens.weight"  # tied head read from the embedding
    block = lazy.load("model.layers.1")
    assert m.model.layers[1] is block and lazy.is_loaded("model.layers.1")
    for n, p in block.named_parameters():
        want = ref.model.layers[1].get_parameter(n)
        assert p.dtype == torch.float32 and torch.equal(p, want.float()), n
    lazy.free("model.layers.1")
    assert not lazy.is_loaded("model.layers.1")
    assert all(p.device.type == "meta" for p in m.model.layers[1].parameters())


def test_shape_mismatch_is_named(sharded, tmp_path):
    d, _ = sharded
    cfg = (d / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')
    (d / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\), the model's"):
        LazyModel.open(d)
