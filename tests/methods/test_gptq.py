"""GPTQ: beats round-to-nearest on correlated inputs, reduces to it when inputs are uncorrelated, and
stays safe on bad Hessians."""

from __future__ import annotations

import logging

import pytest
import torch

from fewbits.formats.quant import quantize_codes
from fewbits.methods.common import MethodError
from fewbits.methods.gptq import gptq_quantize, inverse_hessian_factor, layer_output_error
from fewbits.methods.rtn import rtn_quantize


def _problem(rows: int = 96, cols: int = 256, tokens: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    mix = torch.eye(cols) + torch.randn(cols, cols, generator=g) / cols**0.5
    x = torch.randn(tokens, cols, generator=g) @ mix  # correlated input features
    x[:, 5] *= 8  # one salient channel
    return w, x


@pytest.mark.parametrize("spec", ["int4-g64", "int3-g64", "int4-g64-asym", "int4", "int8", "int3-g32-asym", "int4-t"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_held_out_inputs(spec: str, act_order: bool) -> None:
    w, x = _problem()
    h = x[:768].T @ x[:768]
    held_out = x[768:]
    rtn = layer_output_error(w, rtn_quantize(w, spec).dequantize(), held_out)
    res = gptq_quantize(w, h, spec, act_order=act_order)
    gptq = layer_output_error(w, res.dequantize(), held_out)
    assert gptq < 0.9 * rtn, (spec, act_order, gptq, rtn)
    assert res.codes.dtype == torch.uint8 and res.codes.shape == w.shape


def test_codes_are_what_the_stored_tensor_holds() -> None:
    w, x = _problem()
    for spec in ("int4-g64", "int3-g64-asym", "int2-g64"):
        res = gptq_quantize(w, x.T @ x, spec, act_order=True)
        qt = res.to_tensor()
        assert torch.equal(qt.dequantize(), res.dequantize())
        assert qt.fmt.spec == spec


def test_identity_hessian_gives_round_to_nearest() -> None:
    """With uncorrelated unit inputs there is nothing to compensate: GPTQ's codes are the nearest grid points
    under RTN's (stored) scales.  RTN itself rounds symmetric integers as llama.cpp does (against the scale
    before its fp16 rounding, ties away from zero), which moves a few codes by one step."""
    w, _ = _problem()
    for spec in ("int4", "int4-g64", "int4-g64-narrow", "int3-g64", "int3-g32-asym"):
        res = gptq_quantize(w, torch.eye(w.shape[1]), spec, static_groups=True)
        ref = rtn_quantize(w, spec)
        assert torch.equal(res.scale, ref.scale), spec
        assert torch.equal(res.codes, quantize_codes(w, ref.scale, ref.zero, spec)), spec
        moved = (res.codes.int() - ref.codes.int()).abs()
        assert int(moved.max()) <= 1 and float((moved > 0).float().mean()) < 0.01, spec


def test_singular_hessian_raises_damping_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    w, x = _problem()
    h = x[:16].T @ x[:16]  # rank 16 of 256: singular without damping
    with caplog.at_level(logging.WARNING, logger="fewbits.gptq"):
        res = gptq_quantize(w, h, "int4-g64", damp=0.0)
    assert "not positive definite" in caplog.text
    assert res.info["damp"] > 0
    assert torch.isfinite(res.dequantize()).all()


def test_indefinite_hessian_is_damped_until_it_factorises(caplog: pytest.LogCaptureFixture) -> None:
    w, x = _problem()
    h = x.T @ x
    h -= 0.3 * torch.diag(h).mean() * torch.eye(h.shape[0])  # negative eigenvalues
    with caplog.at_level(logging.WARNING, logger="fewbits.gptq"):
        res = gptq_quantize(w, h, "int4-g64")
    assert caplog.text.count("not positive definite") >= 1
    assert res.info["damp"] >= 0.1
    assert torch.isfinite(res.dequantize()).all()
    fac = inverse_hessian_factor(-torch.eye(8), max_tries=2)
    assert fac is None


def test_dead_columns_keep_their_weights_and_zero_hessian_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    w, x = _problem()
    x[:, 10:20] = 0  # inputs the calibration never excites
    res = gptq_quantize(w, x.T @ x, "int4-g64", static_groups=True)
    ref = rtn_quantize(w, "int4-g64")
    assert res.info["dead_columns"] == 10
    assert torch.equal(res.codes[:, 10:20], ref.codes[:, 10:20])  # rounded, not zeroed
    with caplog.at_level(logging.WARNING, logger="fewbits.gptq"):
        res0 = gptq_quantize(w, torch.zeros(256, 256), "int4-g64", name="experts.3.up")
    assert "experts.3.up" in caplog.text and res0.info["fallback"].startswith("rtn")
    assert torch.equal(res0.codes, ref.codes)


def test_bad_inputs_get_clear_errors() -> None:
    w, x = _problem()
    h = x.T @ x
    with pytest.raises(MethodError, match="gptq.*nf4-g64"):
        gptq_quantize(w, h, "nf4-g64")
    with pytest.raises(MethodError, match="gptq.*fp8-e4m3"):
        gptq_quantize(w, h, "fp8-e4m3")
    with pytest.raises(MethodError, match="Hessian shape"):
        gptq_quantize(w, h[:10, :10], "int4-g64")
    bad = h.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(MethodError, match="NaN"):
        gptq_quantize(w, bad, "int4-g64", name="layers.0.q_proj")
    with pytest.raises(Exception, match="not divisible"):
        gptq_quantize(w[:, :200], h[:200, :200], "int4-g64")


def test_inverse_hessian_factor_does_not_depend_on_the_thread_count() -> None:
    # LAPACK's blocked Cholesky rounds differently on 1 and 2 threads at this size; GPTQ would turn that
    # into different codes, so a torchrun rank (1 thread) and a lone process must factorise alike
    x = torch.randn(512, 1536, generator=torch.Generator().manual_seed(0))
    h = x.T @ x / 512
    before = torch.get_num_threads()
    try:
        factors = []
        for n in (1, 2):
            torch.set_num_threads(n)
            factors.append(inverse_hessian_factor(h)[0])
            assert torch.get_num_threads() == n  # the caller's setting is restored
    finally:
        torch.set_num_threads(before)
    assert torch.equal(factors[0], factors[1])


def _textbook_gptq(w: torch.Tensor, h: torch.Tensor, spec: str, damp: float = 0.01) -> torch.Tensor:
    """GPTQ as the paper first states it, in float64: quantise column q, spread its error with eq. 2 and
    remove q from the inverse Hessian by Gaussian elimination (eq. 3); no Cholesky, no lazy blocks.
    Static per-group scales from the original weights.  Returns the dequantised weight."""
    from fewbits.formats.format import parse_format
    from fewbits.formats.quant import compute_scales

    fmt = parse_format(spec)
    scale, zero = compute_scales(w, fmt)
    g = fmt.group_size
    half = 2 ** (fmt.bits - 1)  # symmetric: full grid -half..half-1, narrow -(half-1)..half-1
    lo, hi = (-half + (fmt.grid == "narrow"), half - 1) if fmt.symmetric else (0, 2**fmt.bits - 1)
    W = w.double().clone()
    H = h.double() + damp * torch.diag(h).double().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    out = torch.zeros_like(W)
    for q in range(W.shape[1]):
        s = scale[:, q // g].double()
        z = zero[:, q // g].double() if zero is not None else 0.0
        out[:, q] = ((torch.round(W[:, q] / s) + z).clamp(lo, hi) - z) * s
        err = (W[:, q] - out[:, q]) / Hinv[q, q]
        W[:, q:] -= torch.outer(err, Hinv[q, q:])
        Hinv -= torch.outer(Hinv[:, q], Hinv[q, :]) / Hinv[q, q]
    return out.float()


@pytest.mark.parametrize("spec", ["int4-g64", "int4-g64-narrow", "int3-g32-asym"])
def test_lazy_blocked_cholesky_form_matches_the_textbook_algorithm(spec: str) -> None:
    """The fast form (upper Cholesky factor of H^-1, lazy blocks of 128 columns, codes recovered per block)
    is the same algorithm as eq. 2 + eq. 3: the same weights up to float32 rounding (a tie rounded the
    other way changes a few codes, and the errors spread from them)."""
    w, x = _problem(rows=64, cols=256, tokens=1024, seed=3)
    h = x.T @ x / x.shape[0]
    ref = _textbook_gptq(w, h, spec)
    res = gptq_quantize(w, h, spec, static_groups=True, block_size=128, act_order=False).dequantize()
    same = (res == ref).float().mean().item()
    assert same > 0.99, same
    e_ref = layer_output_error(w, ref, x)
    e_res = layer_output_error(w, res, x)
    assert abs(e_res - e_ref) < 0.01 * e_ref, (e_res, e_ref)
