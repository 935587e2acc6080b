"""Floating zero points (`-zfp16`, `-zbf16`, `-zfp32`): spec grammar, exact sizes, metadata versions, and
the round-to-nearest grid w = (c - z) * s checked against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from fewbits.formats.format import Format, FormatError, parse_format
from fewbits.formats.quant import compute_scales, dequantize_codes, fake_quantize, quantize_codes

FLOAT_ZERO_SPECS = ["int4-g64-asym-zfp16", "int3-g64-asym-zbf16", "int2-g32-asym-zfp32", "int8-asym-zfp16",
                    "int4-t-asym-zfp16", "int4-g128-asym-sbf16-zfp16"]


@pytest.mark.parametrize("spec", FLOAT_ZERO_SPECS)
def test_float_zero_specs_round_trip(spec: str) -> None:
    fmt = parse_format(spec)
    assert fmt.spec == spec and fmt.float_zeros and not fmt.symmetric
    assert parse_format(fmt.spec) == fmt
    d = fmt.to_dict()
    assert d["version"] == 2 and d["zero_dtype"] == spec.rsplit("-z", 1)[1]
    assert Format.from_dict(d) == fmt


def test_suffix_order_does_not_matter_and_integer_zeros_stay_default() -> None:
    assert parse_format("int4-zfp16-g64-asym").spec == "int4-g64-asym-zfp16"
    assert parse_format("int4-g64-asym").zero_dtype == "int"
    assert not parse_format("int4-g64-asym").float_zeros


@pytest.mark.parametrize("bad", ["int4-g64-zfp16", "fp8-e4m3-zfp16", "nf4-g64-zfp16", "int4-g64-asym-zfp16-zbf16",
                                 "int4-g64-asym-zint", "int4-g64-asym-ze8m0", "mxfp4-zfp16"])
def test_bad_float_zero_specs_raise(bad: str) -> None:
    with pytest.raises(FormatError, match="format|spec"):
        parse_format(bad)


def test_dataclass_checks_float_zeros() -> None:
    with pytest.raises(FormatError, match="asymmetric"):
        Format("int", 4, "group", 64, True, zero_dtype="fp16")
    with pytest.raises(FormatError, match="zero-point dtype"):
        Format("int", 4, "group", 64, False, zero_dtype="fp8")


def test_exact_sizes() -> None:
    # (128, 256) int4-g64: codes 128 * 128 B, scales 128 * 4 fp16, zeros 128 * 4 fp16 (16 bits each)
    f = parse_format("int4-g64-asym-zfp16")
    assert f.nbytes((128, 256)) == 128 * 128 + 128 * 4 * 2 + 128 * 4 * 2 == 18432
    assert f.bits_per_weight() == 4 + 16 / 64 + 16 / 64 == 4.5
    assert f.bits_per_weight((128, 256)) == 4.5
    # integer zeros of the same format: 4 bits per zero, packed row by row
    assert parse_format("int4-g64-asym").nbytes((128, 256)) == 128 * 128 + 128 * 4 * 2 + 128 * 2
    # per tensor: one fp16 scale + one fp16 zero; per channel with fp32 zeros: 32 bits per row
    assert parse_format("int4-t-asym-zfp16").storage_bits((16, 64)) == 16 * 64 * 4 + 16 + 16
    assert parse_format("int8-asym-zfp32").storage_bits((3, 10)) == 3 * 80 + 3 * 16 + 3 * 32
    assert parse_format("int3-g64-asym-zbf16").bits_per_weight() == 3.5


def test_version_1_metadata_still_loads_and_is_still_written() -> None:
    old = {"version": 1, "spec": "int4-g64-asym", "kind": "int", "bits": 4, "granularity": "group",
           "group_size": 64, "symmetric": False, "scale_dtype": "fp16", "element": "int", "tensor_scale": False}
    fmt = Format.from_dict(old)
    assert fmt == parse_format("int4-g64-asym") and fmt.zero_dtype == "int"
    assert fmt.to_dict() == old  # formats version 1 can describe are written exactly as before
    with pytest.raises(FormatError, match="version 1"):
        Format.from_dict({**old, "zero_dtype": "fp16", "spec": "int4-g64-asym-zfp16"})
    bad = parse_format("int4-g64-asym-zfp16").to_dict()
    bad["zero_dtype"] = "bf16"
    with pytest.raises(FormatError, match="inconsistent"):
        Format.from_dict(bad)


def test_float_zero_rtn_by_hand() -> None:
    # one row, per channel, 2 bits: min -0.3, max 1.2 -> s = 1.5 / 3 = 0.5, z = 0.3 / 0.5 = 0.6, stored in
    # fp16 as 0.60009765625 (1229 * 2^-11).  codes round(w / s + z): -0.6+z -> 0, z -> 1, 0.8+z -> 1, 2.4+z -> 3
    w = torch.tensor([[-0.3, 0.0, 0.4, 1.2]])
    fmt = parse_format("int2-asym-zfp16")
    s, z = compute_scales(w, fmt)
    assert s.item() == 0.5 and z.item() == 0.60009765625
    c = quantize_codes(w, s, z, fmt)
    assert c.tolist() == [[0, 1, 1, 3]]
    zf = 0.60009765625
    want = torch.tensor([[(0 - zf) * 0.5, (1 - zf) * 0.5, (1 - zf) * 0.5, (3 - zf) * 0.5]])
    assert torch.equal(dequantize_codes(c, s, z, fmt), want)
    # integer zero points of the same format: z = round(0.6) = 1, w_hat = -0.5, 0, 0.5, 1.0
    assert fake_quantize(w, "int2-asym").tolist() == [[-0.5, 0.0, 0.5, 1.0]]


def test_float_zero_rtn_uses_the_exact_range() -> None:
    # a group entirely above zero: integer zeros widen the range to [0, max]; float zeros do not
    w = torch.linspace(1.0, 2.5, 64).reshape(1, 64)
    for spec in ("int4-g64-asym-zfp16", "int3-g64-asym-zfp16"):
        s, z = compute_scales(w, spec)
        assert s.item() == pytest.approx(1.5 / (2 ** int(spec[3]) - 1), rel=1e-3)
        w_hat = fake_quantize(w, spec)
        assert float((w_hat - w).abs().max()) <= s.item() / 2 + 1e-3  # at most half a step everywhere
        # the integer-zero grid spans [0, 2.5] instead of [1, 2.5]: 5/3 times coarser
        assert float((w_hat - w).abs().max()) < 0.75 * float((fake_quantize(w, spec[:-6]) - w).abs().max())


def test_near_constant_group_keeps_a_finite_fp16_zero() -> None:
    w = torch.tensor([[5.0, 5.0001, 5.0, 5.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    s, z = compute_scales(w, "int2-asym-zfp16")
    assert torch.isfinite(z).all()
    assert torch.allclose(fake_quantize(w, "int2-asym-zfp16"), w, atol=2e-3)
