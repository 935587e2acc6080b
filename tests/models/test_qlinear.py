"""QuantLinear: the reference path equals a dense matmul with the dequantised weight, and the packed
weight lives in buffers that state_dict, load_state_dict and .to() handle exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fewbits.models.qlinear import (
    DequantizedOnce,
    QuantLinear,
    dequantized_once_chooser,
    reference_chooser,
    reference_linear,
)
from fewbits.tensor import quantize_tensor

SPECS = ["int8", "int4-g32", "int4-g16-asym", "int3-g32", "nf4-g32", "fp8-e4m3", "mxfp4", "nvfp4"]


@pytest.fixture
def w():
    return torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_dequantise_then_matmul(w, spec):
    qt = quantize_tensor(w, spec)
    bias = torch.randn(48)
    layer = QuantLinear(qt, bias)
    x = torch.randn(3, 5, 64)
    want = F.linear(x, qt.dequantize(torch.float32), bias)
    assert torch.equal(layer(x), want)
    assert torch.equal(reference_linear(x, qt, bias), want)
    # the cached kernel gives the same bits
    assert torch.equal(QuantLinear(qt, bias, dequantized_once_chooser)(x), want)
    # and the quantised layer is close to the float one (int8 far closer than 3-bit)
    rel = (layer(x) - F.linear(x, w, bias)).norm() / F.linear(x, w, None).norm()
    assert rel < {"int8": 0.01, "fp8-e4m3": 0.05}.get(spec, 0.25)


def test_state_dict_holds_exactly_the_packed_tensors(w):
    qt = quantize_tensor(w, "int4-g16-asym")
    layer = QuantLinear(qt, torch.zeros(48))
    sd = layer.state_dict()
    assert set(sd) == {"qweight_codes", "qweight_scales", "qweight_zeros", "bias"}
    assert sum(v.numel() * v.element_size() for k, v in sd.items() if k != "bias") == qt.nbytes
    assert layer.weight_nbytes == qt.nbytes and layer.fmt_spec == "int4-g16-asym"
    other = QuantLinear(quantize_tensor(torch.randn(48, 64), "int4-g16-asym"), torch.ones(48))
    other.load_state_dict(sd)
    x = torch.randn(2, 64)
    assert torch.equal(other(x), layer(x))  # the kernel was prepared again over the loaded buffers


def test_dtype_casts_leave_the_stored_values_alone(w):
    qt = quantize_tensor(w, "int4-g32")  # fp16 scales
    layer = QuantLinear(qt, torch.randn(48)).to(torch.bfloat16)
    assert layer.qweight_scales.dtype == torch.float16 and layer.qweight_codes.dtype == torch.uint8
    assert layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.qweight.dequantize(), qt.dequantize())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_injected_chooser_runs_the_matmul(w):
    calls = []

    def chooser(qt):
        def kernel(x, bias):
            calls.append(tuple(x.shape))
            return reference_linear(x, qt, bias)
        return kernel

    layer = QuantLinear(quantize_tensor(w, "int8"), None, chooser)
    layer(torch.randn(4, 64))
    assert calls == [(4, 64)]
    assert reference_chooser(layer.qweight).func.__name__ == "_call_reference"


def test_dequantized_once_keeps_one_dense_weight_per_dtype(w):
    k = DequantizedOnce(quantize_tensor(w, "int4-g32"))
    k(torch.randn(2, 64), None)
    k(torch.randn(3, 64), None)
    k(torch.randn(3, 64, dtype=torch.bfloat16), None)
    assert len(k.dense) == 2


def test_bad_shapes_are_clear_errors(w):
    qt = quantize_tensor(w, "int8")
    with pytest.raises(ValueError, match="bias shape"):
        QuantLinear(qt, torch.zeros(7))
    with pytest.raises(ValueError, match=r"input last dimension 63 does not match weight shape \(48, 64\)"):
        QuantLinear(qt)(torch.randn(2, 63))
    with pytest.raises(ValueError, match="2-D"):
        QuantLinear(quantize_tensor(torch.randn(2, 3, 64), "int8"))


# ------------------------------------------------------------------------ codes held once by the kernel
HELD = ["int4-g32", "int4-g64-asym", "int3-g64", "int2-g32", "int4-g128-asym-zfp16", "int8", "int8-asym"]


def _storages(layer: QuantLinear) -> int:
    """Bytes of the distinct storages the layer's buffers and kernel reach."""
    seen: dict[int, int] = {}
    for t in [*layer.buffers(), *(v for v in vars(layer.kernel).values() if isinstance(v, torch.Tensor))]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("spec", HELD)
def test_a_kernel_that_holds_the_codes_is_their_only_copy(spec):
    """With a kernel that repacks the codes (the CPU int4 operator, the int8 ones) the layer drops its codes
    buffer: the state dict, `qweight`, `weight_nbytes` and the output are what they were with the buffer, a
    fresh layer loads that state dict, a move and a change of kernel bring the buffer back."""
    from fewbits.kernels import prepare_linear

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(len(spec))) * 0.05
    qt = quantize_tensor(w, spec)
    kept = QuantLinear(qt, torch.randn(64))  # the reference path: the buffer stays
    layer = QuantLinear(qt, kept.bias.data, prepare_linear)
    if not hasattr(layer.kernel, "unpacked_codes"):
        pytest.skip(f"{spec} runs on {type(layer.kernel).__name__} here, which keeps no codes of its own")
    assert "qweight_codes" not in dict(layer.named_buffers()) and layer.codes_holder is layer.kernel
    sd, want = layer.state_dict(), kept.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    assert sd["qweight_codes"].dtype == torch.uint8
    assert torch.equal(layer.qweight.unpacked_codes(), qt.unpacked_codes())
    assert layer.weight_nbytes == kept.weight_nbytes == qt.nbytes
    assert _storages(layer) < _storages(kept) + layer.kernel.nbytes - qt.codes.numel() // 2
    x = torch.randn(2, 256).to(torch.bfloat16)
    y = layer(x)
    fresh = QuantLinear(quantize_tensor(torch.zeros(64, 256), spec), torch.zeros(64), prepare_linear)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), y) and torch.equal(fresh.state_dict()["qweight_codes"], want["qweight_codes"])
    layer.to(torch.bfloat16)  # prepares the kernel again: still one copy, same output
    assert layer.codes_holder is layer.kernel and torch.equal(layer(x), y)
    layer.set_kernel(reference_chooser)  # a kernel without codes of its own: the buffer is back
    assert layer.codes_holder is None and torch.equal(dict(layer.named_buffers())["qweight_codes"], qt.codes)


def test_model_size_counts_the_codes_the_kernels_hold():
    from fewbits.kernels import prepare_linear
    from fewbits.models.loading import model_bytes
    from fewbits.models.swap import model_nbytes

    qt = quantize_tensor(torch.randn(64, 256) * 0.05, "int4-g32")
    held, kept = torch.nn.Sequential(QuantLinear(qt, None, prepare_linear)), torch.nn.Sequential(QuantLinear(qt))
    assert model_nbytes(held) == model_nbytes(kept) == qt.nbytes
    if held[0].codes_holder is not None:  # model_bytes counts the kernel's codes as packed, once
        assert model_bytes(held) == qt.nbytes
