"""Mixture-of-experts models: fused experts split into one linear per expert projection, quantised like
any linear layer, saved and loaded again; on tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from fewbits import api
from fewbits.export.common import ExportError
from fewbits.formats.format import parse_format
from fewbits.models.moe import ExpertLayoutError, RoutedExperts, unfuse_experts
from fewbits.models.qlinear import QuantLinear
from fewbits.models.recipe import Recipe, Rule
from fewbits.models.swap import linear_shapes

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(5))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _moe_sizes(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config
    n = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return n, cfg.hidden_size, getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size


@pytest.mark.parametrize("family", FAMILIES)
def test_split_experts_compute_what_the_fused_ones_do(tiny_moe, ids, family: str) -> None:
    model = tiny_moe(family)
    ref = _logits(model, ids)
    names = unfuse_experts(model)
    layers = model.config.num_hidden_layers - (1 if family == "qwen2_moe" else 0)  # one dense layer
    assert len(names) == layers and unfuse_experts(model) == []  # a second call finds nothing to split
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-6, atol=1e-6)
    n, h, i = _moe_sizes(model)
    shapes = dict(linear_shapes(model))
    for e in range(n):
        assert shapes[f"{names[0]}.{e}.gate_proj"] == (i, h) and shapes[f"{names[0]}.{e}.down_proj"] == (h, i)
    assert not any(k.endswith("mlp.gate") for k in shapes)  # the router is not a linear layer here


@pytest.mark.parametrize("family", FAMILIES)
def test_rtn_logits_equal_a_fused_model_holding_the_dequantised_weights(tiny_moe, ids, family: str) -> None:
    """The reference is transformers' own fused model with every quantised weight replaced by its
    dequantised values (expert e's gate and up rows of gate_up_proj[e], its down_proj[e])."""
    model = tiny_moe(family)
    ref_model = copy.deepcopy(model)
    report = api.quantize(model, "int4-g32", progress=False, chooser="reference")
    n, h, i = _moe_sizes(model)
    planned = {r["name"]: r for r in report.quantized_layers}
    experts = [k for k in planned if EXPERT.match(k)]
    moe_layers = model.config.num_hidden_layers - (1 if family == "qwen2_moe" else 0)
    assert len(experts) == 3 * n * moe_layers
    if family == "qwen2_moe":  # the shared expert is an ordinary MLP; its one-row gate stays 16-bit
        assert "model.layers.0.mlp.shared_expert.down_proj" in planned
        gate = next(r for r in report.layers if r["name"] == "model.layers.0.mlp.shared_expert_gate")
        assert gate["action"] == "ignore"
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, QuantLinear):
                continue
            w = mod.qweight.dequantize(torch.float32)
            assert planned[name]["bytes_after"] == parse_format("int4-g32").nbytes(tuple(w.shape))
            m = EXPERT.match(name)
            if m is None:
                ref_model.get_submodule(name).weight.copy_(w)
                continue
            fused, e = ref_model.get_submodule(m.group(1)), int(m.group(2))
            rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i)}
            target = fused.down_proj[e] if m.group(3) == "down_proj" else fused.gate_up_proj[e, rows[m.group(3)]]
            target.copy_(w)
    got, want = _logits(model, ids), _logits(ref_model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - _logits(tiny_moe(family), ids)).abs().max() > 1e-3  # quantisation did change the experts


def test_recipes_address_experts_by_name(tiny_moe) -> None:
    model = tiny_moe("mixtral")
    recipe = Recipe((Rule(r"\.mlp\.experts\.\d+\.down_proj$", "int8"), Rule(r"\.experts\.1\.", "int4-g64"),
                     Rule(r".*", "int4-g32")))
    report = api.quantize(model, recipe, progress=False, chooser="reference")
    fmt = {r["name"]: r["format"] for r in report.quantized_layers}
    assert fmt["model.layers.1.mlp.experts.3.down_proj"] == fmt["model.layers.0.mlp.experts.1.down_proj"] == "int8"
    assert fmt["model.layers.0.mlp.experts.1.up_proj"] == "int4-g64"
    assert fmt["model.layers.0.mlp.experts.2.gate_proj"] == fmt["model.layers.0.self_attn.q_proj"] == "int4-g32"


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_gives_identical_logits(tiny_moe, ids, tmp_path, family: str) -> None:
    model = tiny_moe(family)
    report = api.quantize(model, "int4-g32", progress=False, chooser="reference")
    out = api.save_quantized_model(model, Recipe.from_format("int4-g32"), tmp_path / "q", report=report)
    loaded, _, meta = api.load_quantized_model(out, chooser="reference")
    assert meta["experts"] == "unfused"
    assert isinstance(loaded.model.layers[0].mlp.experts, RoutedExperts)
    assert isinstance(loaded.model.layers[0].mlp.experts[3].down_proj, QuantLinear)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_fast_kernels_run_the_experts(tiny_moe, ids) -> None:
    model = tiny_moe("qwen3_moe")
    exact = copy.deepcopy(model)
    report = api.quantize(model, "int4-g32", progress=False)  # the dispatcher: fast paths where there are
    api.quantize(exact, "int4-g32", progress=False, chooser="cached")
    assert sum(api.kernels_in_use(model).values()) == len(report.quantized_layers)
    # bf16 activations on the fast paths: close, not equal (a near-tie in the router may pick another expert)
    fast, ref = _logits(model, ids).log_softmax(-1), _logits(exact, ids).log_softmax(-1)
    kl = float((ref.exp() * (ref - fast)).sum(-1).mean())
    assert kl < 1e-3


def test_exporters_refuse_moe(tiny_moe, tmp_path) -> None:
    from fewbits.export import export_compressed_tensors

    model = tiny_moe("mixtral")
    api.quantize(model, "int4-g32", progress=False, chooser="reference")
    with pytest.raises(ExportError, match="mixture-of-experts"):
        export_compressed_tensors(model, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_an_unknown_fused_layout_is_refused(tiny_moe) -> None:
    model = tiny_moe("mixtral")
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ExpertLayoutError, match=r"model\.layers\.1\.mlp\.experts.*is_transposed=True"):
        unfuse_experts(model)


def test_budget_refuses_moe(tiny_moe) -> None:
    from fewbits.budgeted import BudgetError

    model = tiny_moe("mixtral")
    data = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    with pytest.raises(BudgetError, match="mixture-of-experts"):
        api.budget_recipe(model, data, "bpw=4.25")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mapping_names_every_linear_of_every_block(tiny_moe, family: str) -> None:
    from fewbits.calib.runner import decoder_blocks

    model = tiny_moe(family)
    unfuse_experts(model)
    _, blocks, arch = decoder_blocks(model)
    for block in blocks:
        names = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        assert names - set(arch.linears) <= {"mlp.shared_expert_gate"}  # ignored by default: never planned
    group = next(g for g in arch.sequential if "mlp.experts.0.gate_proj" in g)
    assert arch.same_input(group) == [(f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj") for e in range(4)]
    folds = {(m.prev, m.linears) for m in arch.smooth if m.prev_kind == "linear"}
    assert all((f"mlp.experts.{e}.up_proj", (f"mlp.experts.{e}.down_proj",)) in folds for e in range(4))
    assert not any("experts" in p for m in arch.smooth if m.prev_kind == "norm" for p in m.linears)
