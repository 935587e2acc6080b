"""QuantizedTensor with floating zero points: stored as one float per group, exact byte counts, lossless
dequantisation of what was chosen, save/load, and clear errors for corrupt zero tensors."""

from __future__ import annotations

import pytest
import torch

from fewbits.formats.format import FormatError, parse_format
from fewbits.formats.quant import fake_quantize
from fewbits.tensor import QuantizedTensor, load_quantized, quantize_tensor, save_quantized

SPECS = ["int4-g64-asym-zfp16", "int3-g32-asym-zbf16", "int2-g64-asym-zfp32", "int8-asym-zfp16",
         "int4-t-asym-zfp16"]


def _w(shape=(48, 128), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02 + torch.rand(*shape[:-1], 1, generator=g) * 0.01


@pytest.mark.parametrize("spec", SPECS)
def test_float_zeros_are_stored_as_floats_and_counted_exactly(spec: str) -> None:
    fmt = parse_format(spec)
    w = _w()
    qt = quantize_tensor(w, spec)
    n_scales = 1 if fmt.granularity == "tensor" else 48 * fmt.groups_per_row(128)
    assert qt.zeros.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[fmt.zero_dtype]
    assert qt.zeros.numel() == n_scales
    assert qt.nbytes == sum(t.numel() * t.element_size() for t in qt.state_dict().values()) == fmt.nbytes(w.shape)
    assert torch.equal(qt.dequantize(), fake_quantize(w, spec))
    # the zero points are not integers (the rows are shifted), and the float grid beats the integer one
    assert not torch.equal(qt.zero_values(), qt.zero_values().round())


def test_float_zero_round_trip_error_is_within_half_a_step() -> None:
    w = _w((64, 256), 3)
    qt = quantize_tensor(w, "int4-g64-asym-zfp16")
    step = qt.scale_values().repeat_interleave(64, dim=1)  # (64, 256)
    assert bool(((qt.dequantize() - w).abs() <= step * 0.5 + 1e-6).all())


@pytest.mark.parametrize("spec", SPECS)
def test_save_load_round_trip(spec: str, tmp_path) -> None:
    w = _w((32, 3, 64), 1)  # 3-D: rows are the leading dimensions
    qt = quantize_tensor(w, spec)
    path = tmp_path / "q.safetensors"
    save_quantized(path, {"a": qt, "b": quantize_tensor(w, "int4-g64-asym")})
    back = load_quantized(path)
    assert back["a"].fmt == qt.fmt and back["a"].shape == (32, 3, 64)
    assert torch.equal(back["a"].zeros, qt.zeros)
    assert torch.equal(back["a"].dequantize(), qt.dequantize())
    assert back["b"].fmt.spec == "int4-g64-asym" and back["b"].meta()["format"]["version"] == 1


def test_corrupt_float_zeros_fail_by_name() -> None:
    qt = quantize_tensor(_w(), "int4-g64-asym-zfp16")
    tensors = qt.state_dict("layer.")
    for bad in (tensors["layer.zeros"].float(), tensors["layer.zeros"][:, :1]):
        with pytest.raises(FormatError, match=r"layer.*zero points.*int4-g64-asym-zfp16"):
            QuantizedTensor.from_state_dict({**tensors, "layer.zeros": bad}, "layer.", qt.meta())
    with pytest.raises(FormatError, match="missing"):
        QuantizedTensor.from_state_dict({k: v for k, v in tensors.items() if k != "layer.zeros"}, "layer.", qt.meta())


def test_from_codes_with_float_zeros_matches_quantize_tensor() -> None:
    from fewbits.formats.quant import compute_scales, quantize_codes

    w = _w()
    s, z = compute_scales(w, "int3-g32-asym-zbf16")
    codes = quantize_codes(w, s, z, "int3-g32-asym-zbf16")
    qt = QuantizedTensor.from_codes(codes, s, z, "int3-g32-asym-zbf16", tuple(w.shape))
    ref = quantize_tensor(w, "int3-g32-asym-zbf16")
    assert torch.equal(qt.codes, ref.codes) and torch.equal(qt.zeros, ref.zeros)
