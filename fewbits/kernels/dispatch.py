"""One dispatcher for quantised linear layers: the fastest correct path for a format, shape and device.

Candidates are tried in a fixed order per device (an explicit table, fastest first as measured by
`benchmarks/bench_gemv.py`); the first whose `supports(fmt, shape)` returns None wins.  When none fits,
the reference dequantise-then-matmul path runs, and the reasons each candidate gave are logged.

    kernel = prepare_linear(qt)          # once per layer: packs the weight for the chosen path
    y = kernel(x, bias)                  # every call
    y = linear(x, qt, bias)              # convenience: prepares (and caches per qt) on first use
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fewbits.formats.format import Format, parse_format
from fewbits.kernels import cpu, cpu_int4, cpu_rows, gpu
from fewbits.kernels.reference import ReferenceKernel
from fewbits.tensor import QuantizedTensor

log = logging.getLogger("fewbits.kernels")

#: activation modes: "16" = weight-only (activations stay 16-bit); "int8" / "fp8" = W8A8 (opt-in); "q8" =
#: activations rounded to int8 per block of 32 columns at every row count (`fewbits.kernels.act8`, llama.cpp's
#: Q8_0), where a kernel can (opt-in; the others keep 16-bit activations)
ACTIVATIONS = ("16", "int8", "fp8", "q8")

#: device type -> activation mode -> candidate kernel classes, fastest first
CANDIDATES: dict[str, dict[str, tuple[Any, ...]]] = {
    "cpu": {
        "16": (cpu_int4.Q4Kernel, cpu.Int4PackKernel, cpu_rows.Int8RowsKernel, cpu.Int8PackKernel,
               cpu_rows.Fp8RowsKernel, cpu.Fp8DequantKernel),
        "int8": (cpu.W8A8IntMMKernel, cpu_int4.Q4Kernel, cpu.Int4PackKernel, cpu.Int8PackKernel,
                 cpu_rows.Fp8RowsKernel, cpu.Fp8DequantKernel),
        "fp8": (cpu_int4.Q4Kernel, cpu.Int4PackKernel, cpu_rows.Int8RowsKernel, cpu.Int8PackKernel,
                cpu_rows.Fp8RowsKernel, cpu.Fp8DequantKernel),
        "q8": (cpu_int4.Q4A8Kernel, cpu_rows.Int8RowsA8Kernel, cpu_int4.Q4Kernel, cpu.Int4PackKernel,
               cpu_rows.Int8RowsKernel, cpu.Int8PackKernel, cpu_rows.Fp8RowsKernel, cpu.Fp8DequantKernel),
    },
    "cuda": {
        "16": (gpu.TritonWeightOnlyKernel,),
        "int8": (gpu.TritonWeightOnlyKernel,),
        "fp8": (gpu.FP8ScaledMMKernel, gpu.TritonWeightOnlyKernel),
        "q8": (gpu.TritonWeightOnlyKernel,),
    },
}


class DenseKernel:
    """Unquantised weights (bf16/fp16/fp32 formats): a plain F.linear on the stored values."""

    name = "dense"

    def __init__(self, qt: QuantizedTensor, device: str | torch.device = "cpu") -> None:
        self.w = qt.codes.reshape(qt.shape).to(device)
        self.shape = qt.shape
        self.reason = "unquantised format"

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _device_type(device: str | torch.device | None) -> str:
    return torch.device(device if device is not None else "cpu").type


def choose_kernel(
    fmt: Format | str, shape: tuple[int, ...], device: str | torch.device | None = "cpu", activations: str = "16",
) -> tuple[Callable[[QuantizedTensor], Any], str]:
    """(builder, reason): `builder(qt)` returns a prepared kernel `k(x, bias)`; `reason` says why it was chosen.

    fmt/shape: the weight's format and (out_features, in_features).  activations: "16" for weight-only
    kernels, "int8"/"fp8" to allow kernels that also quantise the activations (W8A8).
    """
    fmt = parse_format(fmt)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if not fmt.is_quantized:
        return (lambda qt: DenseKernel(qt, device or "cpu")), f"{fmt.spec} is not quantised: dense matmul"
    dtype = _device_type(device)
    tried: list[str] = []
    for cls in CANDIDATES.get(dtype, {}).get(activations, ()):
        why = cls.supports(fmt, tuple(shape))
        if why is None:
            if dtype == "cpu":
                return cls, f"{cls.name}: fast path for {fmt.spec} {tuple(shape)} on {dtype}"
            return (lambda qt, c=cls: c(qt, device)), f"{cls.name}: fast path for {fmt.spec} {tuple(shape)} on {dtype}"
        tried.append(f"{cls.name}: {why}")
    reason = "; ".join(tried) if tried else f"no fast kernels for device type {dtype!r}"
    return (lambda qt: ReferenceKernel(qt, reason)), f"reference (dequantise + matmul) for {fmt.spec}: {reason}"


def prepare_linear(
    qt: QuantizedTensor, device: str | torch.device | None = None, activations: str = "16",
) -> Any:
    """Pack `qt` (out, in) for the fastest correct path; falls back to the reference path, logging why.

    The returned kernel is called as `kernel(x, bias)` and has `.name`, `.reason` and `.nbytes`.
    """
    if len(qt.shape) != 2:
        raise ValueError(f"linear weight must be 2-D (out, in), got shape {qt.shape} in format {qt.fmt.spec}")
    builder, reason = choose_kernel(qt.fmt, qt.shape, device or qt.codes.device, activations)
    try:
        kernel = builder(qt)
    except Exception as exc:  # noqa: BLE001 - a packing failure must not break inference
        reason = f"reference: building the fast path failed ({type(exc).__name__}: {exc})"
        kernel = ReferenceKernel(qt, reason)
    kernel.reason = reason
    if kernel.name == "reference":
        log.info("fewbits.kernels: %s %s -> %s", qt.fmt.spec, tuple(qt.shape), reason)
    else:
        log.debug("fewbits.kernels: %s %s -> %s", qt.fmt.spec, tuple(qt.shape), reason)
    return kernel


def prepare_linear_q8(qt: QuantizedTensor, device: str | torch.device | None = None) -> Any:
    """`prepare_linear` in the "q8" activation mode: where a kernel can (`cpu_q4_a8`, `cpu_int8_rows_a8` on a CPU
    with AVX512-VNNI or AVX2), it rounds the activations to int8 per block of 32 columns at every row count, so decode
    and evaluation share the numerics; the rest as in the weight-only mode."""
    return prepare_linear(qt, device, activations="q8")


_PREPARED: dict[tuple[int, str, str], Any] = {}


def linear(
    x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None, activations: str = "16",
) -> torch.Tensor:
    """y = x @ W.T + bias for a quantised W, on the fastest correct path for x's device.

    The packed weight is cached per QuantizedTensor object (dropped when the tensor is collected);
    layers should rather hold `prepare_linear(qt)` themselves.
    """
    key = (id(qt), x.device.type, activations)
    kernel = _PREPARED.get(key)
    if kernel is None:
        kernel = prepare_linear(qt, x.device, activations)
        _PREPARED[key] = kernel
        weakref.finalize(qt, _PREPARED.pop, key, None)
    return kernel(x, bias)
