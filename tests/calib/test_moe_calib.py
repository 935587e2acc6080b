"""Calibrating mixture-of-experts models: each expert's statistics come from the tokens routed to it
(checked against Hessians computed by hand from transformers' own fused model), GPTQ uses each
expert's own Hessian, and an expert that saw too few tokens falls back to round-to-nearest with one
log line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fewbits import api
from fewbits.calib import pipeline
from fewbits.calib.moe import EXPERT_MIN_TOKENS, min_expert_tokens
from fewbits.calib.runner import iterate_blocks
from fewbits.methods.config import GPTQ
from fewbits.methods.rtn import rtn_quantize
from fewbits.models.moe import unfuse_experts
from fewbits.models.recipe import LayerPlan, Recipe, RecipeError, Rule

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def _routed_inputs(model: nn.Module, data: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused model: the MoE block's input tokens (N, H) and the experts each was sent to (N, k)."""
    mlp = model.model.layers[layer].mlp
    xs, idx = [], []
    h1 = mlp.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    h2 = mlp.gate.register_forward_hook(lambda m, a, out: idx.append(out[2]))
    try:
        with torch.no_grad():
            for row in data:  # one sample at a time: routing does not depend on the batch
                model(row[None])
    finally:
        h1.remove()
        h2.remove()
    return torch.cat(xs), torch.cat(idx)


def _reference_hessians(model: nn.Module, data: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
    """path inside block 0 -> (tokens, H / tokens) of each expert's gate_proj and down_proj input,
    computed by hand from the fused weights: X_e = the rows routed to e, Z_e = act(X_e G_e^T) * X_e U_e^T."""
    x, idx = _routed_inputs(model, data)
    experts = model.model.layers[0].mlp.experts
    i = experts.down_proj.shape[-1]
    out = {}
    for e in range(experts.gate_up_proj.shape[0]):
        xe = x[(idx == e).any(-1)].double()
        gu = experts.gate_up_proj[e].double()
        z = experts.act_fn(xe @ gu[:i].T) * (xe @ gu[i:].T)
        out[f"mlp.experts.{e}.gate_proj"] = (len(xe), xe.T @ xe / len(xe))
        out[f"mlp.experts.{e}.down_proj"] = (len(xe), z.T @ z / len(xe))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_hessians_come_from_the_tokens_routed_to_them(tiny_moe, calib_ids, family: str) -> None:
    model = tiny_moe(family)
    ref = _reference_hessians(model, calib_ids)
    counts = {ref[p][0] for p in ref}
    assert len(counts) > 1 and max(counts) < calib_ids.numel() * 2  # uneven routing: a real test
    unfuse_experts(model)
    run = next(iterate_blocks(model, calib_ids))
    stats = run.collect({p: run.module(p) for p in ref}, want_hessian=True, stop_early=False, want_abs=False)
    for p, (n, h) in ref.items():
        assert stats[p].tokens == n, p
        torch.testing.assert_close(stats[p].hessian_mean().double(), h, rtol=1e-4, atol=1e-6)
    if family == "qwen2_moe":  # the shared expert sees every token
        st = run.collect({"mlp.shared_expert.gate_proj": run.module("mlp.shared_expert.gate_proj")})
        assert st["mlp.shared_expert.gate_proj"].tokens == calib_ids.numel()


def test_gptq_quantises_each_expert_with_its_own_hessian(tiny_moe, calib_ids, monkeypatch) -> None:
    """Only the experts planned, so block 0's experts see the float model's inputs: every GPTQ call on
    an expert's gate and up rows gets that expert's hand-computed H, and lowers the H-weighted error
    tr(dW H dW^T) below round-to-nearest's."""
    model = tiny_moe("mixtral")
    ref = _reference_hessians(model, calib_ids)
    calls: list[tuple[str, torch.Tensor, torch.Tensor, object]] = []
    real = pipeline.gptq_quantize

    def spy(w, h, fmt, name="", **kw):
        res = real(w, h, fmt, name=name, **kw)
        calls.append((name, w.clone(), h.clone(), res))
        return res

    monkeypatch.setattr(pipeline, "gptq_quantize", spy)
    api.quantize(model, Recipe((Rule(r"\.mlp\.experts\.", "int4-g32", "gptq"),)), data=calib_ids, progress=False,
                 chooser="reference")
    seen = 0
    for name, w, h, res in calls:
        if not name.startswith("model.layers.0.") or "gate_proj" not in name:
            continue
        e = name.split(".")[5]
        assert name == f"model.layers.0.mlp.experts.{e}.gate_proj+model.layers.0.mlp.experts.{e}.up_proj"
        torch.testing.assert_close(h.double(), ref[f"mlp.experts.{e}.gate_proj"][1], rtol=1e-4, atol=1e-6)
        dw_gptq = w - res.dequantize()
        dw_rtn = w - rtn_quantize(w, "int4-g32").dequantize()
        err = [float(torch.trace(d.double() @ h.double() @ d.double().T)) for d in (dw_gptq, dw_rtn)]
        assert err[0] < err[1]
        seen += 1
    assert seen == 4  # one call per expert: its gate and up rows stacked on its one Hessian


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_expert_with_too_few_tokens_falls_back_to_rtn(tiny_moe, calib_ids, caplog, method: str) -> None:
    """A threshold between the fewest tokens an expert of block 0 saw and the next count: the down_proj
    of the least used expert(s), and no other linear of the block, gets round-to-nearest, exactly, with
    one log line naming it."""
    model = tiny_moe("qwen3_moe")
    ref = _reference_hessians(model, calib_ids)
    counts = {e: ref[f"mlp.experts.{e}.gate_proj"][0] for e in range(4)}
    lo = min(counts.values())
    above = min(c for c in counts.values() if c > lo)
    frac = (lo + above) / 2 / 96  # as a fraction of the down_proj's 96 inputs; gate/up (64 inputs) stay above
    starved = {f"model.layers.0.mlp.experts.{e}.down_proj": e for e, c in counts.items() if c == lo}
    busiest = max(counts, key=counts.get)
    fused = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    recipe = Recipe((Rule(r"\.mlp\.experts\.", "int4-g32", method, {"expert_min_tokens": frac}),))
    with caplog.at_level(logging.WARNING, logger="fewbits.calib"):
        report = api.quantize(model, recipe, data=calib_ids, progress=False, chooser="reference")
    fallback = report.method_info[method]["rtn_fallback"]
    assert {k for k in fallback if k.startswith("model.layers.0.")} == set(starved)

    def rtn_codes(e: int) -> torch.Tensor:
        return rtn_quantize(fused[e], "int4-g32").to_tensor(tuple(fused[e].shape)).codes

    for name, e in starved.items():
        assert f"sent this expert {lo} calibration token" in fallback[name]
        lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
        assert len(lines) == 1 and "round-to-nearest" in lines[0]
        assert torch.equal(model.get_submodule(name).qweight.codes, rtn_codes(e))
    # the rule is real: a calibrated expert's codes are not round-to-nearest's
    calibrated = model.get_submodule(f"model.layers.0.mlp.experts.{busiest}.down_proj").qweight.codes
    assert not torch.equal(calibrated, rtn_codes(busiest))


def test_the_threshold_option_is_checked() -> None:
    plan = LayerPlan("model.layers.0.mlp.experts.0.down_proj", (64, 96), "quantize", "int4-g32", "gptq")
    assert min_expert_tokens(plan) == EXPERT_MIN_TOKENS == 1.0
    assert min_expert_tokens(LayerPlan(plan.name, plan.shape, "quantize", "int4-g32", "gptq",
                                       GPTQ(expert_min_tokens=0.25))) == 0.25
    for method in ("gptq", "awq", "awq+gptq"):
        with pytest.raises(RecipeError, match=r"option expert_min_tokens must be a number"):
            Rule(r"\.experts\.", "int4-g32", method, {"expert_min_tokens": "many"})
        with pytest.raises(RecipeError, match=r"option expert_min_tokens must be at least 0"):
            Rule(r"\.experts\.", "int4-g32", method, {"expert_min_tokens": -1})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq", "hqq"])
def test_every_method_quantises_every_expert(tiny_moe, calib_ids, eval_ids, family: str, method: str) -> None:
    """All experts quantised (the default threshold is met on this text, or RTN where not), and the
    model stays close to the float one."""
    model = tiny_moe(family)
    with torch.no_grad():
        ref = model(eval_ids).logits.float().log_softmax(-1)
    data = calib_ids if method != "hqq" else None
    report = api.quantize(model, Recipe.from_format("int4-g32", method=method), data=data, progress=False,
                          chooser="reference")
    experts = [r for r in report.quantized_layers if ".mlp.experts." in r["name"]]
    assert len(experts) == 3 * 4 * 2  # 4 experts in each of 2 MoE layers (Qwen2-MoE: and a dense one)
    with torch.no_grad():
        got = model(eval_ids).logits.float().log_softmax(-1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert 0 < kl < 0.02, kl


def test_hessian_passes_bound_the_memory_of_expert_hessians() -> None:
    from fewbits.calib.moe import hessian_passes
    from fewbits.models.mappings import mapping_for

    arch = mapping_for("mixtral").with_experts(4)
    gate_up = next(g for g in arch.sequential if "mlp.experts.0.gate_proj" in g)
    width = dict.fromkeys(gate_up, 64)
    one = 4 * 3 * 64 * 64  # bytes of one expert's Hessian: two float32 partial sums and the mean
    assert hessian_passes(arch, gate_up, width, budget=4 * one) == [gate_up]
    halves = hessian_passes(arch, gate_up, width, budget=2 * one)
    assert halves == [gate_up[:4], gate_up[4:]]  # experts 0-1, then 2-3: an expert's gate and up stay together
    assert len(hessian_passes(arch, gate_up, width, budget=1)) == 4  # at least one expert per pass
    qkv = arch.sequential[0]
    assert hessian_passes(arch, qkv, dict.fromkeys(qkv, 64), budget=1) == [qkv]


def test_one_expert_per_pass_gives_the_same_codes(tiny_moe, calib_ids, monkeypatch) -> None:
    """Experts' inputs do not depend on each other: collecting their Hessians one expert per pass (a
    tight memory budget) quantises exactly as one pass for all."""
    from fewbits.calib import moe
    from fewbits.calib.runner import BlockRun

    passes = [0]
    real = BlockRun.collect

    def counted(self, *a, **kw):
        passes[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(BlockRun, "collect", counted)
    codes, counts = [], []
    for budget in (moe.EXPERT_HESSIAN_BYTES, 1):
        monkeypatch.setattr(moe, "EXPERT_HESSIAN_BYTES", budget)
        passes[0] = 0
        model = tiny_moe("qwen2_moe")
        api.quantize(model, Recipe.from_format("int4-g32", method="gptq"), data=calib_ids, progress=False,
                     chooser="reference")
        codes.append({n: m.qweight.codes for n, m in model.named_modules() if hasattr(m, "qweight_meta")})
        counts.append(passes[0])
    assert counts[1] == counts[0] + 2 * 2 * 3  # 2 MoE blocks x 2 expert groups x 3 more passes (4 experts)
    assert codes[0].keys() == codes[1].keys()
    assert all(torch.equal(codes[0][n], codes[1][n]) for n in codes[0])
