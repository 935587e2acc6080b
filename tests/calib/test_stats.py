"""Input statistics: the Hessian sum against float64, and its independence of how samples are split."""

from __future__ import annotations

import pytest
import torch

from fewbits.calib.stats import HESSIAN_CHUNKS, CalibrationError, InputStats, bf16_products, mean_of_partials
from fewbits.methods.backend import ENV, numba_available


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


@pytest.mark.skipif(not numba_available(), reason="numba not installed: nothing to compare")
@pytest.mark.parametrize("n_parts", [1, 2, 3])
def test_mean_of_partials_torch_and_compiled_give_the_same_bits(n_parts: int) -> None:
    """The plain-torch mean (any device) and its compiled CPU form sum in float64 in the same order: the
    same bits, and those of folding into float64 then dividing (the textbook form)."""
    g = torch.Generator().manual_seed(n_parts)
    parts = []
    for _ in range(n_parts):
        x = torch.randn(200, 96, generator=g) * torch.rand(96, generator=g) * 5
        parts.append(x.T @ x)
    plain = mean_of_partials(parts, 777, backend="torch")
    compiled = mean_of_partials(parts, 777, backend="numba")
    ref = sum(p.double() for p in parts) / 777  # ((p0 + p1) + p2) in float64
    assert plain.dtype == compiled.dtype == torch.float32
    assert torch.equal(plain, compiled)
    assert torch.equal(plain, ref.float())


@pytest.mark.skipif(not numba_available(), reason="numba not installed: nothing to compare")
def test_hessian_mean_follows_the_backend_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = _samples()
    means = {}
    for be in ("torch", "numba"):
        monkeypatch.setenv(ENV, be)
        st = InputStats("lin", 48)
        for i, x in enumerate(xs):
            st.add(x, (i,))
        means[be] = st.hessian_mean()
    assert torch.equal(means["torch"], means["numba"])
