"""ModelSpec for the mixture-of-experts families: parameter counts equal transformers' own models (tiny
random ones, every layout: Mixtral, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE) and
the published totals of the real ones."""

from __future__ import annotations

import pytest

from fewbits.models.presets import get_preset
from fewbits.models.spec import ModelSpec, ModelSpecError


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_parameter_counts_equal_the_transformers_model(tiny_moe, family: str) -> None:
    model = tiny_moe(family)
    spec = ModelSpec.from_config_dict(model.config.to_dict(), name=family)
    assert spec.n_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert spec.n_linear_params(("expert",)) == experts
    # a token runs 2 of the 4 experts: the other half of the expert weights is idle
    assert spec.n_params - spec.n_active_params == experts // 2
    if family == "qwen2_moe":
        assert (spec.n_moe_layers, spec.shared_expert_size, spec.expert_intermediate_size) == (2, 128, 96)


@pytest.mark.parametrize(("name", "total", "active"), [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),      # Qwen/Qwen3-30B-A3B model card: 30.5B, 3.3B activated
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9),  # Qwen/Qwen1.5-MoE-A2.7B model card: 14.3B, 2.7B activated
])
def test_published_moe_totals(name: str, total: float, active: float) -> None:
    s = get_preset(name)
    assert round(s.n_params / 1e8) == round(total / 1e8)
    assert s.n_active_params == pytest.approx(active, rel=0.02)  # the cards round 3.35B down to 3.3B


def test_sparse_layer_fields_are_checked() -> None:
    cfg = dict(model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
               intermediate_size=128, vocab_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert ModelSpec.from_config_dict({**cfg, "mlp_only_layers": [0, 2]}).n_moe_layers == 2
    assert ModelSpec.from_config_dict({**cfg, "decoder_sparse_step": 2}).n_moe_layers == 2  # layers 1 and 3
    with pytest.raises(ModelSpecError, match="mlp_only_layers"):
        ModelSpec.from_config_dict({**cfg, "mlp_only_layers": "all"})
    with pytest.raises(ModelSpecError, match="no layer holds experts"):
        ModelSpec.from_config_dict({**cfg, "mlp_only_layers": [0, 1, 2, 3]})
    with pytest.raises(ModelSpecError, match="moe_intermediate_size"):
        ModelSpec.from_config_dict({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
