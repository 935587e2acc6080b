import ml_dtypes
import numpy as np
import pytest
import torch

from fewbits.formats.grids import (
    E2M1,
    E4M3,
    E5M2,
    NF4_LEVELS,
    decode_minifloat,
    e8m0_exponent,
    encode_minifloat,
    minifloat_grid,
    nf4_round,
    round_minifloat,
)


def _all_finite_fp16() -> torch.Tensor:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return x[torch.isfinite(x)].float()


def test_e4m3_matches_torch_bit_for_bit_on_every_finite_fp16():
    x = _all_finite_fp16()
    ours = encode_minifloat(round_minifloat(x, E4M3, saturate=True), E4M3)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)  # torch's CPU conversion saturates to +-448
    assert torch.equal(ours, ref)


def test_e5m2_matches_torch_bit_for_bit_on_every_finite_fp16():
    x = _all_finite_fp16()
    ours = encode_minifloat(round_minifloat(x, E5M2, saturate=False), E5M2)
    ref = x.to(torch.float8_e5m2).view(torch.uint8)  # overflow -> inf, as torch
    assert torch.equal(ours, ref)
    sat = round_minifloat(x, E5M2, saturate=True)
    assert sat.abs().max() == 57344.0
    finite = torch.isfinite(x.to(torch.float8_e5m2).float())
    assert torch.equal(sat[finite], x[finite].to(torch.float8_e5m2).float())


@pytest.mark.parametrize("fmt, dt", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_decode_matches_torch_for_all_256_patterns(fmt, dt):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, ref = decode_minifloat(bits, fmt), bits.view(dt).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(ours[~torch.isnan(ours)], ref[~torch.isnan(ref)])


def test_fp4_grid_and_patterns_match_ml_dtypes():
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ours = decode_minifloat(torch.arange(16), E2M1).numpy()
    np.testing.assert_array_equal(ours, ref)
    assert minifloat_grid(E2M1).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_fp4_rounding_matches_ml_dtypes():
    x = torch.linspace(-7, 7, 2801)
    ours = round_minifloat(x, E2M1, saturate=True)
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours.numpy(), ref)


def test_e8m0_scale_matches_ocp_mx_rule():
    # shared exponent = floor(log2(amax)) - emax_elem; E2M1 emax = 2, E4M3 emax = 8
    amax = torch.tensor([6.0, 7.9, 8.0, 0.75, 448.0])
    assert e8m0_exponent(amax, E2M1).tolist() == [0, 0, 1, -3, 6]
    assert e8m0_exponent(torch.tensor([448.0, 1.0]), E4M3).tolist() == [0, -8]
    # the scale is a valid float8_e8m0fnu value
    s = torch.exp2(e8m0_exponent(amax, E2M1)).numpy()
    np.testing.assert_array_equal(s.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), s)


def test_nf4_levels_and_nearest_rounding():
    lv = torch.tensor(NF4_LEVELS)
    assert len(NF4_LEVELS) == 16 and lv[7] == 0 and lv[0] == -1 and lv[15] == 1
    assert torch.all(lv[1:] > lv[:-1])
    x = torch.rand(1000) * 2 - 1
    idx = nf4_round(x).long()
    brute = (x[:, None] - lv[None, :]).abs().argmin(1)
    assert torch.equal(lv[idx], lv[brute])


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1])
def test_fast_codes_equal_the_reference_on_every_finite_fp16(fmt):
    from fewbits.formats.grids import from_codes, to_codes

    x = _all_finite_fp16()
    ref = encode_minifloat(round_minifloat(x, fmt, saturate=True), fmt)
    fast = to_codes(x, fmt)
    assert torch.equal(fast, ref)
    assert torch.equal(from_codes(fast, fmt), decode_minifloat(ref, fmt))


def test_encoding_rounds_values_a_float_rounding_off_the_grid() -> None:
    # an NVFP4 block scale is stored as (scale * t) / t, which lands one ulp off its E4M3 grid point
    t = torch.tensor(1.2057669664500281e-05)
    for v in (448.0, 416.0, 240.0, 0.015625, 0.001953125):
        off = (torch.tensor(v) * t) / t
        for x in (off, torch.nextafter(torch.tensor(v), torch.tensor(0.0)), torch.nextafter(torch.tensor(v),
                                                                                          torch.tensor(1e9))):
            code = encode_minifloat(x.reshape(1), E4M3)
            assert decode_minifloat(code, E4M3).item() == v
            assert code.item() == torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8).item()
