"""Per-token measures against hand-computed values, and perplexity/compare on a tiny model against
the model's own loss."""

from __future__ import annotations

import math

import pytest
import torch

from fewbits.eval.metrics import Accumulated, kl_per_token, log_probs, token_nll, top1_agree
from fewbits.eval.perplexity import Window, compare, fill_reference_cache, perplexity


def test_kl_by_hand():
    # p = (0.5, 0.25, 0.25), q = (0.25, 0.5, 0.25): KL(p||q) = 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2
    p = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    q = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    assert kl_per_token(log_probs(p), log_probs(q)).item() == pytest.approx(0.25 * math.log(2), rel=1e-6)
    assert kl_per_token(log_probs(p), log_probs(p)).item() == 0.0
    assert top1_agree(p, q).tolist() == [False] and top1_agree(p, p).tolist() == [True]


def test_nll_matches_cross_entropy_and_uniform_perplexity_is_vocab():
    z = torch.randn(7, 11)
    y = torch.randint(0, 11, (7,))
    assert torch.allclose(token_nll(log_probs(z), y), torch.nn.functional.cross_entropy(z, y, reduction="none"))
    acc = Accumulated()
    acc.add(token_nll(log_probs(torch.zeros(5, 50)), torch.arange(5)))
    assert acc.summary()["ppl"] == pytest.approx(50.0, rel=1e-6)


def test_accumulated_summary_percentile_and_top1():
    acc = Accumulated()
    kl = torch.arange(100, dtype=torch.float32) / 100  # 0.00 .. 0.99
    acc.add(torch.zeros(100), torch.zeros(100), kl, torch.arange(100) < 25)
    s = acc.summary()
    assert s["kl_mean"] == pytest.approx(0.495)
    assert s["kl_p99"] == pytest.approx(0.9801)  # linear interpolation between 0.98 and 0.99
    assert s["top1"] == 0.25 and s["ppl"] == 1.0 and s["delta_ppl"] == 0.0 and s["tokens"] == 100


class Uniformish(torch.nn.Module):
    """A 'model' whose logits are a fixed function of the input ids (for exact expectations)."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, input_ids, use_cache=False):  # noqa: ANN001, ANN201
        z = torch.nn.functional.one_hot(input_ids, 16).float() * 2.0
        z[..., 0] += self.shift * (input_ids % 3 == 0)  # token 0 more likely after multiples of 3
        return type("Out", (), {"logits": z})()


def test_perplexity_and_compare_on_the_model_own_loss(tiny_llama):
    g = torch.Generator().manual_seed(0)
    wins = [Window(c, i, torch.randint(0, 320, (24,), generator=g)) for c in ("a", "b") for i in range(3)]
    res = perplexity(tiny_llama, wins, batch=4, progress=False)
    with torch.no_grad():
        losses = [tiny_llama(input_ids=w.ids[None], labels=w.ids[None]).loss.item() for w in wins]
    assert res["overall"]["ppl"] == pytest.approx(math.exp(sum(losses) / 6), rel=1e-5)
    assert res["categories"]["a"]["ppl"] == pytest.approx(math.exp(sum(losses[:3]) / 3), rel=1e-5)
    assert res["overall"]["tokens"] == 6 * 23
    same = compare(tiny_llama, tiny_llama, wins, progress=False)["overall"]
    assert same["kl_mean"] == 0.0 and same["top1"] == 1.0 and same["delta_ppl"] == 0.0
    # a cached reference gives the same numbers as a live one
    other = Uniformish(shift=0.7)
    ref = Uniformish()
    wins16 = [Window("x", i, torch.randint(0, 16, (9,), generator=g)) for i in range(3)]
    live = compare(other, ref, wins16, progress=False)
    cache = fill_reference_cache(ref, wins16, progress=False)
    cached = compare(other, None, wins16, ref_cache=cache, progress=False)
    assert live == cached and live["overall"]["kl_mean"] > 0
    with pytest.raises(ValueError, match="no reference model and no cached reference"):
        compare(other, None, wins16, ref_cache={}, progress=False)
