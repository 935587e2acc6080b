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
from fewbits.methods.registry import METHODS

#: method name -> (format kinds it accepts, what it needs), from each method's config (`methods/config.py`)
METHOD_FORMATS: dict[str, tuple[frozenset[str], str]] = {n: (e.config.kinds or frozenset(), e.config.takes)
                                                           for n, e in METHODS.items()}
#: methods that accept floating zero points (`-zfp16` formats): their codes come from the numeric core's
#: grid (`formats.quant`) or, for HQQ, optimise the float zero.  GPTQ's column loop rounds on an integer
#: grid (round(w / s) + z), which a fractional zero point would break, so it (and awq+gptq) refuses them.
FLOAT_ZERO_METHODS = frozenset(n for n, e in METHODS.items() if e.config.float_zeros)
#: methods that need calibration text
CALIBRATED = frozenset(n for n, e in METHODS.items() if e.needs_data)


class MethodError(FormatError):
    """A method that cannot work with a format, or was given data it cannot use."""


def check_method_format(method: str, fmt: Format | str) -> Format:
    """Raise MethodError naming the method and the format when they do not go together (the method's
    config says which formats it takes)."""
    fmt = parse_format(fmt)
    if method not in METHODS:
        raise MethodError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    problem = METHODS[method].config().format_problem(fmt, method)
    if problem:
        raise MethodError(problem)
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
