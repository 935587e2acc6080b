"""The block-by-block runner on tiny models: exact replay of the float model, every method quantises
every planned layer, and bad cases get clear messages and safe results."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fewbits.calib.pipeline import run_awq, run_awq_gptq, run_gptq, run_hqq
from fewbits.calib.runner import BATCH_TOKENS, CalibrationError, iterate_blocks, sample_batches
from fewbits.calib.stats import HESSIAN_CHUNKS
from fewbits.calib.w8a8 import run_llm_int8, run_smoothquant
from fewbits.methods.common import MethodError
from fewbits.models.recipe import Recipe
from fewbits.models.swap import linear_shapes, swap_in

RUNNERS = {"gptq": run_gptq, "awq": run_awq, "awq+gptq": run_awq_gptq, "hqq": run_hqq,
           "smoothquant": run_smoothquant, "llm-int8": run_llm_int8}


def quantize(model: nn.Module, method: str, spec: str, data: torch.Tensor | None, ignore=None, options=None) -> dict:
    """Plan with a recipe, run the method's runner with a commit that swaps layers in; returns info."""
    recipe = Recipe.from_format(spec, method=method) if ignore is None else \
        Recipe.from_format(spec, method=method, ignore=ignore)
    plans = [p for p in recipe.plan(linear_shapes(model)) if p.action == "quantize"]
    if options:
        from dataclasses import replace

        from fewbits.methods.registry import config_for
        plans = [replace(p, config=config_for(method, options)) for p in plans]
    done: list[str] = []

    def commit(name, q):
        assert name not in done
        done.append(name)
        swap_in(model, name, q)

    info = RUNNERS[method](model, plans, data, commit, False) if method != "rtn" else None
    assert sorted(done) == sorted(p.name for p in plans)
    return info or {}


def _logp(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float().log_softmax(-1)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_replaying_blocks_reproduces_the_model(tiny, calib_ids, family: str) -> None:
    model = tiny(family)
    with torch.no_grad():
        ref = model(calib_ids, output_hidden_states=True)
        runs = list(iterate_blocks(model, calib_ids))  # each block's outputs feed the next
        outs = runs[-1].advance()
    order = torch.tensor([s for batch in runs[-1].batches for s in batch])  # batches group samples by class
    assert sorted(order.tolist()) == list(range(calib_ids.shape[0]))
    final = model.model.norm(torch.cat(outs))[torch.argsort(order)]
    assert torch.allclose(final, ref.hidden_states[-1], atol=1e-5), float((final - ref.hidden_states[-1]).abs().max())


@pytest.mark.parametrize("method,spec", [("gptq", "int3-g32"), ("awq", "int3-g32"), ("awq+gptq", "int3-g32"),
                                         ("hqq", "int3-g32-asym")])
def test_weight_methods_beat_rtn_on_a_tiny_model(tiny, calib_ids, eval_ids, method: str, spec: str) -> None:
    ref = _logp(tiny(), eval_ids)
    rtn_model = tiny()
    for name, _ in linear_shapes(rtn_model):
        if "lm_head" not in name:
            from fewbits.tensor import quantize_tensor
            swap_in(rtn_model, name, quantize_tensor(rtn_model.get_submodule(name).weight, spec.replace("-asym", "")
                                                     if method != "hqq" else spec))
    model = tiny()
    quantize(model, method, spec, calib_ids)
    got = _kl(ref, _logp(model, eval_ids))
    assert torch.isfinite(torch.tensor(got))
    assert got < _kl(ref, _logp(rtn_model, eval_ids)), method


def test_w8a8_methods_run_and_stay_close(tiny, calib_ids, eval_ids) -> None:
    ref = _logp(tiny(), eval_ids)
    for method in ("smoothquant", "llm-int8"):
        model = tiny()
        quantize(model, method, "int8", calib_ids)
        assert _kl(ref, _logp(model, eval_ids)) < 1e-3, method


def test_gemma_layout_runs_awq_and_gptq(tiny, calib_ids, eval_ids) -> None:
    ref = _logp(tiny("gemma3"), eval_ids)
    model = tiny("gemma3")
    info = quantize(model, "awq+gptq", "int8", calib_ids)
    assert any(k.endswith("pre_feedforward_layernorm") for k in info["awq_alpha"])
    assert _kl(ref, _logp(model, eval_ids)) < 1e-3


def test_unreached_and_outside_layers_fall_back_to_rtn(tiny, calib_ids, caplog) -> None:
    model = tiny()
    model.model.layers[0].mlp.expert_7 = nn.Linear(64, 128)  # an expert no token is routed to
    with caplog.at_level(logging.WARNING, logger="fewbits.calib"):
        info = quantize(model, "gptq", "int4-g32", calib_ids, ignore=(r"embed",))
    fb = info["rtn_fallback"]
    assert "never reached" in fb["model.layers.0.mlp.expert_7"]
    assert "outside the decoder blocks" in fb["lm_head"]
    assert "model.layers.0.mlp.expert_7" in caplog.text and "round-to-nearest" in caplog.text


def test_nan_activations_name_the_layer(tiny, calib_ids) -> None:
    model = tiny()
    norm = model.model.layers[1].input_layernorm
    norm.register_forward_hook(lambda m, a, out: out * float("nan"))
    with pytest.raises(CalibrationError, match=r"model\.layers\.1\.self_attn\.q_proj.*NaN"):
        quantize(model, "gptq", "int4-g32", calib_ids)


def test_too_little_calibration_text(tiny) -> None:
    with pytest.raises(CalibrationError, match="at least 128 tokens"):
        quantize(tiny(), "gptq", "int4-g32", torch.randint(0, 256, (2, 16)))
    with pytest.raises(CalibrationError, match="needs calibration text"):
        quantize(tiny(), "awq", "int4-g32", None)


def test_wrong_format_fails_before_anything_changes(tiny, calib_ids) -> None:
    model = tiny()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(MethodError, match="gptq.*nf4-g32"):
        RUNNERS["gptq"](model, Recipe.from_format("nf4-g32", "gptq").plan(linear_shapes(model)), calib_ids,
                        lambda n, q: None, False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_replaying_quantised_modules_gives_the_same_codes(tiny, calib_ids, family: str, method: str,
                                                          monkeypatch, caplog) -> None:
    """Attention and MLP replayed from their output linear's recorded input (once the linears before it are
    quantised), and norms frozen once nothing before them changes, give exactly the codes of running every
    pass in full; no replay is ever switched off."""
    import dataclasses

    from fewbits.calib import pipeline
    from fewbits.models import mappings

    def codes(replay: bool) -> dict[str, torch.Tensor]:
        if not replay:
            for k, a in list(mappings.ARCHITECTURES.items()):
                monkeypatch.setitem(mappings.ARCHITECTURES, k, dataclasses.replace(a, outputs=()))
            monkeypatch.setattr(pipeline, "_freeze_norms", lambda *a: None)
        model = tiny(family, layers=4)
        quantize(model, method, "int4-g32", calib_ids)
        return {n: b for n, b in model.named_buffers() if "codes" in n or "scale" in n}

    with caplog.at_level(logging.WARNING, logger="fewbits.calib"):
        replayed = codes(True)
    assert "does not reproduce" not in caplog.text
    full = codes(False)
    assert replayed.keys() == full.keys() and len(full) >= 2 * 4 * 7
    for name, t in full.items():
        assert torch.equal(replayed[name], t), name


def test_a_frozen_module_gives_copies_of_its_first_output_per_batch_until_the_block_is_done() -> None:
    from fewbits.calib.runner import BlockRun

    block = nn.Sequential(nn.LayerNorm(4))
    run = BlockRun(0, "b", block, [(0,), (1,)], [], [])
    x = {b: torch.randn(2, 4) for b in run.batches}
    first = {}
    run.freeze("0")
    for b in run.batches:
        run.batch_ref[0] = b
        first[b] = block(x[b])
    with torch.no_grad():
        block[0].weight.mul_(3)  # a change the frozen output must not see
    for b in run.batches:
        run.batch_ref[0] = b
        out = block(torch.zeros(2, 4))
        assert torch.equal(out, first[b])
        out.add_(1)  # the caller's copy: the next call is unchanged
        assert torch.equal(block(torch.zeros(2, 4)), first[b])
    run.finish()
    run.batch_ref[0] = (0,)
    assert not torch.equal(block(x[(0,)]), first[(0,)])  # the real module again


def test_a_replay_found_exact_is_not_checked_again_in_later_blocks_of_the_run() -> None:
    from fewbits.calib.runner import BlockRun

    calls: list[int] = []

    class Attn(nn.Module):  # its output is its linear's output
        def __init__(self) -> None:
            super().__init__()
            self.o = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return self.o(x)

    verified: dict = {}
    for i in range(3):
        block = nn.ModuleDict({"attn": Attn()})
        run = BlockRun(i, f"b.{i}", block, [(0,)], [], [], verified=verified)
        x = torch.randn(2, 4)
        run.recorded["attn.o"] = {(0,): x}
        run.batch_ref[0] = (0,)
        run.replay("attn", "attn.o")
        with torch.no_grad():
            assert torch.equal(block["attn"](x), block["attn"].o(x))
        run.finish()
    assert len(calls) == 1  # block 0 ran the real module to check the replay; blocks 1 and 2 trusted it


def test_a_wrongly_declared_replay_is_detected_and_switched_off(tiny, calib_ids, monkeypatch, caplog) -> None:
    """Declaring a pair whose module output is not the linear's output (attention is not down_proj) must not
    change the result: the first replayed call runs the real module, sees the mismatch and turns replay off."""
    import dataclasses

    from fewbits.models import mappings

    model = tiny("llama")
    ref_info = quantize(model, "gptq", "int4-g32", calib_ids)
    ref = {n: b for n, b in model.named_buffers() if "codes" in n}
    bad = dataclasses.replace(mappings.ARCHITECTURES["llama"], outputs=(("self_attn", "mlp.down_proj"),))
    monkeypatch.setitem(mappings.ARCHITECTURES, "llama", bad)
    model = tiny("llama")
    with caplog.at_level(logging.WARNING, logger="fewbits.calib"):
        info = quantize(model, "gptq", "int4-g32", calib_ids)
    assert "does not reproduce its output" in caplog.text
    assert info.keys() == ref_info.keys()
    for name, t in ((n, b) for n, b in model.named_buffers() if "codes" in n):
        assert torch.equal(ref[name], t), name


@pytest.mark.parametrize("n,seq", [(16, 256), (6, 128), (3, 2048), (16, 16)])
def test_batches_are_the_same_whatever_the_process_count(n: int, seq: int) -> None:
    alone = sample_batches(list(range(n)), seq)
    assert sorted(s for b in alone for s in b) == list(range(n))
    assert all(len({s % HESSIAN_CHUNKS for s in b}) == 1 for b in alone)  # one Hessian partial per batch
    assert all(len(b) * seq <= max(BATCH_TOKENS, seq) for b in alone)
    for world in (w for w in (2, 4) if HESSIAN_CHUNKS % w == 0):  # a class on one rank
        ranks = [sample_batches(list(range(r, n, world)), seq) for r in range(world)]
        assert sorted(b for r in ranks for b in r) == sorted(alone)
