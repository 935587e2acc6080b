"""What every method returns, and which formats each method accepts.

A method chooses codes; it returns them as plain data (`QuantResult`: unpacked uint8 codes, float32
scales and zero points in the layout of `fewbits.formats.quant`).  `QuantResult.to_tensor()` builds the
stored `QuantizedTensor`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fewbits.formats.format import Format, FormatError, parse_format
from fewbits.formats.quant import ScaleRangeError, dequantize_codes

#: method name -> (format kinds it accepts, what it needs), checked before any work is done
METHOD_FORMATS: dict[str, tuple[frozenset[str], str]] = {
    "rtn": (frozenset({"int", "fp8", "fp4", "nf4", "mxfp4", "mxfp8", "nvfp4", "ggml"}), "any quantised format"),
    "gptq": (frozenset({"int"}), "integer formats (int2..int8, any grouping, sym or asym)"),
    "awq": (frozenset({"int"}), "integer formats (int2..int8, any grouping, sym or asym)"),
    "awq+gptq": (frozenset({"int"}), "integer formats (int2..int8, any grouping, sym or asym)"),
    "hqq": (frozenset({"int"}), "integer formats, best with float zero points (e.g. int4-g64-asym-zfp16)"),
    "smoothquant": (frozenset({"int"}), "8-bit per-channel integer weights (int8)"),
    "llm-int8": (frozenset({"int"}), "8-bit per-channel integer weights (int8)"),
}
#: methods that accept floating zero points (`-zfp16` formats): their codes come from the numeric core's
#: grid (`formats.quant`) or, for HQQ, optimise the float zero.  GPTQ's column loop rounds on an integer
#: grid (round(w / s) + z), which a fractional zero point would break, so it (and awq+gptq) refuses them.
FLOAT_ZERO_METHODS = frozenset({"rtn", "hqq", "awq"})
#: methods that need calibration text
CALIBRATED = frozenset({"gptq", "awq", "awq+gptq", "smoothquant"})


class MethodError(FormatError):
    """A method that cannot work with a format, or was given data it cannot use."""


def check_method_format(method: str, fmt: Format | str) -> Format:
    """Raise MethodError naming the method and the format when they do not go together."""
    fmt = parse_format(fmt)
    if method not in METHOD_FORMATS:
        raise MethodError(f"unknown method {method!r}; one of {', '.join(METHOD_FORMATS)}")
    kinds, what = METHOD_FORMATS[method]
    if not fmt.is_quantized:
        raise MethodError(f"method {method} needs a quantised format, got {fmt.spec}")
    if fmt.kind not in kinds:
        raise MethodError(f"method {method} does not work with format {fmt.spec}: it takes {what}")
    if method in ("smoothquant", "llm-int8") and (fmt.bits != 8 or fmt.granularity != "channel"):
        raise MethodError(f"method {method} does not work with format {fmt.spec}: it takes {what}")
    if fmt.float_zeros and method not in FLOAT_ZERO_METHODS:
        plain = fmt.spec.replace(f"-z{fmt.zero_dtype}", "")
        raise MethodError(f"method {method} does not work with format {fmt.spec}: floating zero points "
                          f"(-z{fmt.zero_dtype}) are taken by {', '.join(sorted(FLOAT_ZERO_METHODS))}; "
                          f"use {plain} (integer zero points) with {method}")
    return fmt


@contextmanager
def naming(name: str) -> Iterator[None]:
    """Prefix a ScaleRangeError raised inside with the tensor's name (the scale check does not know it)."""
    try:
        yield
    except ScaleRangeError as exc:
        raise ScaleRangeError(f"{name}: {exc}") from None


def column_format(fmt: Format) -> Format:
    """The per-channel variant of an integer format: quantises any column slice with (rows, 1) scales."""
    return replace(fmt, granularity="channel", group_size=0)


@dataclass
class QuantResult:
    """Codes a method chose for a weight (rows, cols): unpacked uint8 codes, scales (rows, n_groups)
    (or (1, 1) per tensor) and zero points (same shape, None when symmetric)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    fmt: Format
    info: dict[str, Any] = field(default_factory=dict)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scale, self.zero, self.fmt, dtype=dtype)

    def to_tensor(self, shape: tuple[int, ...] | None = None) -> Any:
        """The stored `QuantizedTensor` (packed) for these codes."""
        from fewbits.tensor import QuantizedTensor

        shape = tuple(shape) if shape is not None else tuple(self.codes.shape)
        return QuantizedTensor.from_codes(self.codes, self.scale, self.zero, self.fmt, shape)
