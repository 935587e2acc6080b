"""ModelSpec: exact parameter counts of published checkpoints, from presets and from config.json files.

The fixtures in data/ are the published config.json files (trimmed of tokenizer-only fields).  The
expected counts are the published ones; they were also checked once against transformers models built on
the meta device (sum of parameter numel, and the list of nn.Linear weight shapes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewbits.formats.format import parse_format
from fewbits.models.presets import PRESET_CONFIGS, get_preset, resolve_model
from fewbits.models.spec import ModelSpec, ModelSpecError

DATA = Path(__file__).parent / "data"

PUBLISHED = {
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "gemma-2-9b": 9_241_705_984,
    "smollm2-135m": 134_515_008,
    "gemma-3-270m": 268_098_176,
    "qwen3-0.6b": 596_049_920,
    "qwen2.5-0.5b": 494_032_768,
    "phi-3-mini": 3_821_079_552,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_preset_parameter_counts_equal_published(name: str, count: int) -> None:
    assert get_preset(name).n_params == count


def test_llama3_8b_by_hand() -> None:
    s = get_preset("llama-3-8b")
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert s.n_params == 32 * per_layer + 2 * 128256 * 4096 + 4096
    # linear layers incl. the LM head, without norms or embeddings: the P_m of the decode model
    assert s.n_linear_params() == 7_504_658_432
    assert s.kv_values_per_token == 2 * 32 * 8 * 128
    assert len(s.linear_shapes()) == 8 and sum(x.count for x in s.linear_shapes()) == 7 * 32 + 1


def test_mixtral_active_params() -> None:
    s = get_preset("mixtral-8x7b")
    attn = 2 * 4096 * 4096 + 2 * 1024 * 4096
    per_layer = attn + 2 * 3 * 4096 * 14336 + 8 * 4096 + 2 * 4096
    assert s.n_active_params == 32 * per_layer + 2 * 32000 * 4096 + 4096 == 12_879_925_248
    assert get_preset("llama-3-8b").n_active_params == get_preset("llama-3-8b").n_params


@pytest.mark.parametrize("fixture,count", [
    ("llama3_8b_config.json", 8_030_261_248),
    ("mistral_7b_config.json", 7_241_732_096),
    ("mixtral_8x7b_config.json", 46_702_792_704),
    ("qwen2.5_7b_config.json", 7_615_616_512),
    ("qwen3_0.6b_config.json", 596_049_920),
    ("gemma_2b_config.json", 2_506_172_416),
    ("gemma2_9b_config.json", 9_241_705_984),
    ("gemma3_270m_config.json", 268_098_176),
    ("gemma3_4b_config.json", 3_880_263_168),  # the text model of Gemma-3-4B (vision tower not counted)
    ("phi3_mini_config.json", 3_821_079_552),
    ("smollm2_135m_config.json", 134_515_008),
])
def test_from_hf_config_exact_counts(fixture: str, count: int) -> None:
    assert ModelSpec.from_hf_config(DATA / fixture).n_params == count


def test_family_details_from_configs() -> None:
    qwen2 = ModelSpec.from_hf_config(DATA / "qwen2.5_7b_config.json")
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.n_bias_params == 28 * (3584 + 2 * 512)
    qwen3 = ModelSpec.from_hf_config(DATA / "qwen3_0.6b_config.json")
    assert qwen3.qk_norm and qwen3.tie_embeddings and qwen3.head_dim == 128 and qwen3.q_dim == 2048
    g3 = ModelSpec.from_hf_config(DATA / "gemma3_4b_config.json")  # nested text_config, omitted defaults
    assert (g3.family, g3.n_heads, g3.n_kv_heads, g3.head_dim, g3.vocab_size) == ("gemma3_text", 8, 4, 256, 262208)
    assert g3.norms_per_layer == 4 and g3.tie_embeddings
    phi = ModelSpec.from_hf_config(DATA / "phi3_mini_config.json")
    names = [s.name for s in phi.linear_shapes()]
    assert names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert phi.linear_shapes()[0].shape == (3 * 3072, 3072)
    mix = ModelSpec.from_hf_config(DATA / "mixtral_8x7b_config.json")
    assert (mix.n_experts, mix.experts_per_token) == (8, 2)
    mistral = ModelSpec.from_hf_config(DATA / "mistral_7b_config.json", name="mistral-7b")
    assert mistral == get_preset("mistral-7b")


def test_tied_lm_head_read_but_stored_once() -> None:
    s = get_preset("smollm2-135m")
    lm = [x for x in s.linear_shapes() if x.role == "lm_head"][0]
    assert lm.tied and lm.shape == (49152, 576)
    assert s.n_linear_params() - s.n_linear_params(stored=True) == 49152 * 576


def test_weight_bytes_come_from_format_nbytes() -> None:
    s = get_preset("llama-3-8b")
    for spec, bpw in (("bf16", 16), ("int8-t", 8), ("int4-g128", 4.125)):
        fmt = parse_format(spec)
        total = sum(x.count * fmt.nbytes(x.shape) for x in s.linear_shapes())
        assert total == pytest.approx(s.n_linear_params() * bpw / 8, rel=1e-6)
    assert sum(x.count * parse_format("bf16").nbytes(x.shape) for x in s.linear_shapes()) == 2 * 7_504_658_432


def test_missing_field_is_named(tmp_path: Path) -> None:
    cfg = json.loads((DATA / "llama3_8b_config.json").read_text())
    del cfg["intermediate_size"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match=r"intermediate_size.*|config.json"):
        ModelSpec.from_hf_config(p)
    with pytest.raises(ModelSpecError) as e:
        ModelSpec.from_hf_config(tmp_path)  # a folder holding config.json
    assert "'intermediate_size'" in str(e.value) and str(p) in str(e.value)


def test_bad_configs(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelSpecError, match="bert.*not supported"):
        ModelSpec.from_hf_config(p)
    with pytest.raises(ModelSpecError, match="no config.json"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
    mix = json.loads((DATA / "mixtral_8x7b_config.json").read_text())
    del mix["num_experts_per_tok"]
    p.write_text(json.dumps(mix))
    with pytest.raises(ModelSpecError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config(p)


def test_unknown_preset_suggests_close_names() -> None:
    with pytest.raises(ModelSpecError, match="did you mean llama-3-8b"):
        get_preset("lama-3-8b")
    assert resolve_model("Llama3-8B").name == "llama-3-8b"
    assert resolve_model(str(DATA / "smollm2_135m_config.json")).n_params == 134_515_008
    assert set(PUBLISHED) <= set(PRESET_CONFIGS)


def test_spec_round_trips_and_validates() -> None:
    s = get_preset("gemma-2-9b")
    assert ModelSpec.from_dict(s.to_dict()) == s
    with pytest.raises(ModelSpecError, match="KV heads"):
        ModelSpec("x", "llama", 2, 64, 6, 4, 16, 128, 100)
    with pytest.raises(ModelSpecError, match="hidden_size"):
        ModelSpec("x", "llama", 2, 0, 4, 4, 16, 128, 100)
