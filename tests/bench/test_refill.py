"""The refill of the compiled step: the streams change no value, spread and front skeletons read the same bytes."""

from __future__ import annotations

import math

import torch

from fewbits.bench.probe import skeleton_model
from fewbits.bench.refill import CompiledRefill, Streamed, install_streams
from fewbits.models.spec import ModelSpec

TINY = ModelSpec(name="tiny", family="llama", n_layers=3, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=512)


def _streams(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    return [[getattr(m, f"w{i}") for i in range(m.n)] for m in (layer.input_layernorm for layer in model.model.layers)]


def test_streams_spread_or_front_read_the_same_weights_and_change_no_value():
    plain = skeleton_model(TINY)
    ws = [torch.randn(40, 16).bfloat16() for _ in range(TINY.n_layers)]
    spread, front = skeleton_model(TINY), skeleton_model(TINY)
    install_streams(spread, ws, spread=True)
    install_streams(front, ws, spread=False)
    assert all(isinstance(layer.input_layernorm, Streamed) for layer in spread.model.layers)
    s, f = _streams(spread), _streams(front)
    assert [len(x) for x in s] == [1, 1, 1] and [len(x) for x in f] == [3, 0, 0]
    assert all(a is b for a, b in zip((x[0] for x in s), f[0], strict=True))  # the same tensors, other places
    ids = torch.randint(0, TINY.vocab_size, (1, 6))
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(spread(ids).logits, want) and torch.equal(front(ids).logits, want)


def test_compiled_refill_measures_both_skeletons_per_size():
    cr = CompiledRefill(lambda: skeleton_model(TINY), {1.0: 1 << 16}, TINY.vocab_size, TINY.hidden_size, context=8,
                        steps=2)
    rests: dict[float, dict[bool, float]] = {}
    cr.measure(rests, rounds=2)
    assert set(rests) == {1.0} and set(rests[1.0]) == {True, False}
    assert all(math.isfinite(v) and v > 0 for v in rests[1.0].values())
    spread, front = cr._models
    assert [len(x) for x in _streams(spread)] == [1, 1, 1] and [len(x) for x in _streams(front)] == [3, 0, 0]
    assert _streams(spread)[0][0].shape == (512, TINY.hidden_size)  # 64 KiB of bf16, the model's width


def test_refill_cost_streams_through_every_layer_and_leaves_no_hooks(monkeypatch):
    import fewbits.generate
    from fewbits.bench.refill import refill_cost

    model = skeleton_model(TINY)
    seen = []
    real = fewbits.generate.generate

    def spy(m, ids, n, kv="bf16"):
        seen.append(n)
        return real(m, ids, n, kv=kv)

    monkeypatch.setattr(fewbits.generate, "generate", spy)
    e = refill_cost(model, TINY, 1 << 16, context=8, steps=2, rounds=1)
    assert math.isfinite(e) and seen == [3, 3]
    assert not any(m._forward_pre_hooks for m in model.modules())
