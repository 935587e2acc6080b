"""Input statistics: the Hessian sum against float64, and its independence of how samples are split."""

from __future__ import annotations

import pytest
import torch

from fewbits.calib.stats import HESSIAN_CHUNKS, CalibrationError, InputStats, bf16_products


def _samples(n: int = 16, tokens: int = 64, d: int = 48) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, tokens, d, generator=g) * torch.rand(d, generator=g) * 4 for _ in range(n)]


def test_hessian_is_the_sum_of_x_xT_and_the_abs_statistics_are_right() -> None:
    xs = _samples()
    st = InputStats("lin", 48)
    for i, x in enumerate(xs):
        st.add(x, (i,))
    X = torch.cat([x.reshape(-1, 48) for x in xs]).double()
    ref = X.T @ X
    h = st.hessian_mean().double() * st.tokens
    assert st.tokens == X.shape[0]
    assert float((h - ref).norm() / ref.norm()) < 1e-6
    assert torch.allclose(st.absmax, X.abs().amax(0).float())
    assert torch.allclose(st.mean_abs.double(), X.abs().mean(0), rtol=1e-6)


def test_bfloat16_inputs_take_the_bf16_path_to_float32_accuracy_and_others_do_not() -> None:
    """bfloat16 inputs are exact in bfloat16, so their products on the bfloat16 path keep float32
    accuracy; float32 inputs keep the plain float32 product (the path would round them); the flag is
    restored afterwards."""
    xs = [x.bfloat16() for x in _samples(d=320)]
    st = InputStats("lin", 320)
    for i, x in enumerate(xs):
        st.add(x, (i,))
    X = torch.cat([x.reshape(-1, 320) for x in xs]).double()
    ref = X.T @ X
    assert float((st.hessian_mean().double() * st.tokens - ref).norm() / ref.norm()) < 1e-6
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"
    xf = torch.randn(64, 320) * 3
    plain = InputStats("lin", 320)
    plain.add(xf[None], (0,))
    assert torch.equal(plain.partial[0], xf.T @ xf)
    with bf16_products():
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"


def test_hessian_mean_in_one_pass_equals_fold_then_divide() -> None:
    xs = _samples()
    a, b = InputStats("lin", 48), InputStats("lin", 48)
    for i, x in enumerate(xs[:7]):  # classes with 2, 2, 2 and 1 samples
        a.add(x, (i,))
        b.add(x, (i,))
    b.fold()
    assert torch.equal(a.hessian_mean(), (b.hessian / b.tokens).float())
    assert torch.equal(a.hessian_mean(), b.hessian_mean())  # a second call gives the same


@pytest.mark.parametrize("world", [w for w in (2, 4) if HESSIAN_CHUNKS % w == 0])
def test_split_like_ranks_gives_the_same_float64_hessian(world: int) -> None:
    """Sample i runs on rank i mod world; the ranks' folded Hessians add up to the lone process's,
    bit for bit, when world divides HESSIAN_CHUNKS."""
    assert HESSIAN_CHUNKS % world == 0
    xs = _samples()
    alone = InputStats("lin", 48)
    for i, x in enumerate(xs):
        alone.add(x, (i,))
    alone.fold()
    ranks = [InputStats("lin", 48) for _ in range(world)]
    for i, x in enumerate(xs):
        ranks[i % world].add(x, (i,))
    for r in ranks:
        r.fold()
    total = ranks[0].hessian.clone()
    for r in ranks[1:]:
        total += r.hessian  # what all_reduce_sum does
    assert torch.equal(total.float(), alone.hessian.float())


def test_nan_in_a_later_sample_is_reported_with_its_index() -> None:
    xs = _samples(n=6)
    xs[5][0, 3, 7] = float("nan")
    st = InputStats("layers.2.mlp.down_proj", 48)
    for i in range(5):
        st.add(xs[i], (i,))
    with pytest.raises(CalibrationError, match=r"layers\.2\.mlp\.down_proj.*sample\(s\) \[5\]"):
        st.add(xs[5], (5,))


def test_a_batch_keeps_the_inputs_of_its_first_samples_by_index() -> None:
    xs = torch.stack([x[0] for x in _samples(n=4)])  # one forward pass over samples 0, 4, 8, 12
    st = InputStats("lin", 48, keep_samples=5)
    st.add(xs, (0, 4, 8, 12))
    assert sorted(st.kept) == [0, 4]
    assert torch.equal(st.inputs(), torch.cat([xs[0], xs[1]]))
    assert st.tokens == 4 * 64
