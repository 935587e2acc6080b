"""The probe's stand-in linear layers and the work between the matmuls at the model's widths (`width_cost`)."""

from __future__ import annotations

import pytest
import torch

from fewbits.bench.probe import skeleton_model, skeleton_widths, width_fields
from fewbits.bench.probe_calls import StandInLinear, stand_in, stand_in_model, width_cost
from fewbits.models.spec import ModelSpec

SPEC = ModelSpec(name="tiny", family="llama", n_layers=4, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=256, tie_embeddings=True, max_position_embeddings=4096)


def test_the_stand_in_gives_a_linears_shape_with_x_in_its_first_columns():
    x = torch.randn(3, 1, 8, dtype=torch.bfloat16)
    wide, narrow = stand_in(x, 20), stand_in(x, 5)
    assert wide.shape == (3, 1, 20) and wide.dtype == torch.bfloat16 and narrow.shape == (3, 1, 5)
    assert torch.equal(wide[..., :8], x) and not wide[..., 8:].any() and torch.equal(narrow, x[..., :5])
    assert wide.data_ptr() != x.data_ptr()  # its own output, as a matmul's


def test_the_stand_in_stays_one_opaque_call_in_a_compiled_graph():
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    f = torch.compile(lambda x: torch.ops.fewbits_probe.stand_in(x, 12) * 2, backend=backend, fullgraph=True)
    x = torch.randn(2, 1, 8)
    assert torch.equal(f(x), stand_in(x, 12) * 2)
    assert any("fewbits_probe.stand_in" in t for t in seen)


@pytest.mark.parametrize("hidden,inter", [(64, 96), skeleton_widths(SPEC)])
def test_a_stand_in_model_has_the_widths_and_no_matmul_weights(hidden, inter):
    m = stand_in_model(SPEC, hidden, inter, depth=2)
    assert len(m.model.layers) == 2 and m.config.hidden_size == hidden and m.config.intermediate_size == inter
    assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
    assert isinstance(m.lm_head, StandInLinear) and m.lm_head.out_features == SPEC.vocab_size
    mlp = m.model.layers[0].mlp
    assert (mlp.gate_proj.in_features, mlp.gate_proj.out_features) == (hidden, inter)
    assert mlp.down_proj.out_features == hidden
    # its only weights: the embedding and the norms (the matmuls' would be (4 x 64 x 64 + 3 x 64 x 96) a layer)
    n = sum(p.numel() for p in m.parameters())
    assert n == SPEC.vocab_size * hidden + hidden * (2 * 2 + 1)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in m.parameters())
    # the rotary buffers computed as a normally built model's (not left as the meta tensors' empty memory)
    ref = skeleton_model(SPEC)
    assert torch.equal(m.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    ids = torch.randint(0, SPEC.vocab_size, (2, 5))
    with torch.no_grad():
        logits = m(ids).logits
    assert logits.shape == (2, 5, SPEC.vocab_size) and torch.isfinite(logits.float()).all()


def test_width_cost_is_the_wide_models_steps_less_the_skeletons_per_layer_and_width(monkeypatch):
    """Fake steps: 1 ms + 2 us per layer and per row for every 64 columns of width (a row: hidden + intermediate):
    the cost per layer and width element comes back at each batch, the same for any depth."""
    import fewbits.decode.generate
    from fewbits.generate import GenerationResult

    ran = []

    def fake_static(model, ids, n, kv="bf16", between=None):
        c = model.config
        b = ids.shape[0]
        ran.append((c.hidden_size, c.num_hidden_layers, b))
        t = 1e-3 + 2e-6 * c.num_hidden_layers * b * (c.hidden_size + c.intermediate_size) / 64
        return GenerationResult(ids[:, :1], ids.shape[1], 0.0, [t + 1e-4, t])

    monkeypatch.setattr(fewbits.decode.generate, "generate_static", fake_static)
    for depth in (2, 3):
        got = width_cost(SPEC, batches=(1, 8), depth=depth, steps=2, rounds=2)
        assert got == {1: pytest.approx(2e-6 / 64), 8: pytest.approx(8 * 2e-6 / 64)}
    assert {h for h, _, _ in ran} == {64, skeleton_widths(SPEC)[0]} and {d for _, d, _ in ran} == {2, 3}


def test_a_model_no_wider_than_the_skeleton_costs_nothing_more():
    narrow = ModelSpec(**{**SPEC.__dict__, "hidden_size": 8, "intermediate_size": 8})
    assert width_cost(narrow, batches=(1, 8)) == {1: 0.0, 8: 0.0}


def test_width_fields_are_one_rate_per_row_through_the_origin():
    # 2e-12 at batch 1, 9e-12 at batch 8: least squares through the origin, (1 x 2 + 8 x 9) / (1 + 64) per row
    rate = (2e-12 + 8 * 9e-12) / 65
    assert width_fields({1: 2e-12, 8: 9e-12}) == {"width_overhead_s": pytest.approx(rate),
                                                  "width_overhead_per_seq_s": pytest.approx(rate)}
    exact = width_fields({1: 1e-12, 8: 8e-12})  # proportional to the rows: that rate exactly
    assert exact == {"width_overhead_s": pytest.approx(1e-12), "width_overhead_per_seq_s": pytest.approx(1e-12)}
    assert width_fields({1: 0.0, 8: 0.0}) == {"width_overhead_s": 0.0, "width_overhead_per_seq_s": 0.0}
    assert width_fields({}) == {"width_overhead_s": 0.0, "width_overhead_per_seq_s": 0.0}
