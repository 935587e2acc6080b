"""QuantizedTensor: packed codes + scales (+ zero points, + a tensor scale) + the original shape + Format.

Storage (all row-major over `rows = numel / shape[-1]` rows of `cols = shape[-1]` values):
    codes         uint8 (rows, ceil(cols * bits / 8)), each row a little-endian bit stream (formats/packing.py)
    scales        (rows, n_groups) in the scale dtype: fp16/bf16/fp32, E8M0 as uint8 (exponent + 127),
                  E4M3 as uint8 bit patterns; (1, 1) for per-tensor formats
    zeros         uint8 (rows, ceil(n_groups * bits / 8)), packed like the codes (asymmetric int only);
                  for floating zero points (`-zfp16` formats) one value per scale, (rows, n_groups) or (1, 1),
                  in the zero dtype (fp16/bf16/fp32)
    tensor_scale  fp32 scalar (NVFP4 only)
Unquantised formats (bf16/fp16/fp32) keep the values themselves in `codes` with their own dtype.

Files are safetensors with JSON metadata (never pickle): see `save_quantized` / `load_quantized`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fewbits.files import write_file
from fewbits.formats.format import Format, FormatError, parse_format
from fewbits.formats.ggml_types import GGML_TYPES
from fewbits.formats.grids import E4M3, decode_minifloat, encode_minifloat
from fewbits.formats.packing import pack_bits, unpack_bits
from fewbits.formats.quant import (
    _TORCH_SCALE,
    ScaleRangeError,
    all_finite,
    as_2d,
    dequantize_codes,
    n_groups,
    nvfp4_tensor_scale,
    round_to_nearest,
)

FILE_VERSION = 1
_FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _store_scale(s: torch.Tensor, fmt: Format, ts: torch.Tensor | None) -> torch.Tensor:
    """float32 scales -> the dtype they are stored in."""
    if fmt.kind == "ggml":  # block header bytes (formats/ggml.py)
        return s.round().to(torch.uint8)
    if fmt.scale_dtype == "e8m0":
        return (torch.log2(s) + 127).round().to(torch.uint8)
    if fmt.scale_dtype == "e4m3":
        return encode_minifloat(s / ts if ts is not None else s, E4M3)
    return s.to(_TORCH_SCALE[fmt.scale_dtype])


def _load_scale(s: torch.Tensor, fmt: Format, ts: torch.Tensor | None) -> torch.Tensor:
    """Stored scales -> float32 effective scales (for llama.cpp block types: the header bytes)."""
    if fmt.kind == "ggml":
        return s.float()
    if fmt.scale_dtype == "e8m0":
        return torch.exp2(s.float() - 127)
    if fmt.scale_dtype == "e4m3":
        v = decode_minifloat(s, E4M3)
        return v * ts.float() if ts is not None else v
    return s.float()


@dataclass
class QuantizedTensor:
    """A tensor stored in a quantised Format.  `nbytes` is exactly the bytes of the stored tensors."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    shape: tuple[int, ...]
    fmt: Format

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format | str,
        shape: tuple[int, ...] | None = None, tensor_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Build from unpacked codes (rows, cols) and float32 scales/zeros as `formats.quant` returns them."""
        fmt = parse_format(fmt)
        rows, cols = codes.shape
        shape = tuple(shape) if shape is not None else (rows, cols)
        if fmt.kind == "nvfp4" and tensor_scale is None:
            raise FormatError("nvfp4 needs its FP32 tensor scale")
        zeros = None
        if zero is not None and fmt.float_zeros:
            zeros = zero.to(_TORCH_SCALE[fmt.zero_dtype]).reshape(zero.shape[0], -1).contiguous()
        elif zero is not None:
            zeros = pack_bits(zero.to(torch.uint8).reshape(zero.shape[0], -1), fmt.bits)
        return cls(
            codes=pack_bits(codes, fmt.bits),
            scales=_store_scale(scale.float(), fmt, tensor_scale),
            zeros=zeros,
            tensor_scale=tensor_scale.float().reshape(()) if tensor_scale is not None else None,
            shape=shape,
            fmt=fmt,
        )

    # ------------------------------------------------------------------ views
    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape) // self.cols

    def unpacked_codes(self) -> torch.Tensor:
        """Codes as uint8 (rows, cols)."""
        return unpack_bits(self.codes, self.fmt.bits, self.cols)

    def scale_values(self) -> torch.Tensor:
        """Effective float32 scales, (rows, n_groups) or (1, 1)."""
        return _load_scale(self.scales, self.fmt, self.tensor_scale)

    def zero_values(self) -> torch.Tensor | None:
        if self.zeros is None:
            return None
        if self.fmt.float_zeros:
            return self.zeros.float()
        ng = 1 if self.fmt.granularity == "tensor" else n_groups(self.fmt, self.cols)
        return unpack_bits(self.zeros, self.fmt.bits, ng).float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored values as a dense tensor of the original shape."""
        if not self.fmt.is_quantized:
            return self.codes.to(dtype).reshape(self.shape)
        w = dequantize_codes(self.unpacked_codes(), self.scale_values(), self.zero_values(), self.fmt, dtype)
        return w.reshape(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes + scales + zeros + tensor scale."""
        parts = [self.codes, self.scales, self.zeros, self.tensor_scale]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.fmt.spec}, shape={self.shape}, nbytes={self.nbytes})"

    # ------------------------------------------------------------------ (de)serialisation
    def meta(self) -> dict[str, Any]:
        return {"format": self.fmt.to_dict(), "shape": list(self.shape)}

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {f"{prefix}codes": self.codes}
        for key in ("scales", "zeros", "tensor_scale"):
            t = getattr(self, key)
            if t is not None:
                out[f"{prefix}{key}"] = t
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], prefix: str, meta: dict[str, Any]) -> QuantizedTensor:
        fmt = Format.from_dict(meta["format"])
        shape = tuple(int(d) for d in meta["shape"])
        if f"{prefix}codes" not in tensors:
            raise FormatError(f"{prefix or 'tensor'}: no codes stored")
        qt = cls(
            codes=tensors[f"{prefix}codes"],
            scales=tensors.get(f"{prefix}scales"),
            zeros=tensors.get(f"{prefix}zeros"),
            tensor_scale=tensors.get(f"{prefix}tensor_scale"),
            shape=shape,
            fmt=fmt,
        )
        qt._validate(prefix or "tensor")
        return qt

    def _validate(self, name: str) -> None:
        """Check the stored tensors against shape and format (a corrupt file fails here, by name)."""
        fmt, rows, cols = self.fmt, self.rows, self.cols
        if not fmt.is_quantized:
            want = (rows * cols,) if self.codes.dim() == 1 else tuple(self.codes.shape)
            if math.prod(want) != rows * cols:
                raise FormatError(f"{name}: {self.codes.numel()} values stored for shape {self.shape}")
            return
        want_codes = (rows, -(-cols * fmt.bits // 8))
        if tuple(self.codes.shape) != want_codes or self.codes.dtype != torch.uint8:
            raise FormatError(f"{name}: codes {tuple(self.codes.shape)} {self.codes.dtype} do not match "
                              f"shape {self.shape} in format {fmt.spec} (expected {want_codes} uint8)")
        ng = 1 if fmt.granularity == "tensor" else n_groups(fmt, cols)
        want_scales = (1, 1) if fmt.granularity == "tensor" else (rows, ng)
        if fmt.kind == "ggml":  # header bytes per block
            want_scales = (rows, ng * GGML_TYPES[fmt.element].header_bytes)
        if self.scales is None or tuple(self.scales.shape) != want_scales:
            got = None if self.scales is None else tuple(self.scales.shape)
            raise FormatError(f"{name}: scales {got} do not match shape {self.shape} in format {fmt.spec} "
                              f"(expected {want_scales})")
        byte_scales = fmt.kind == "ggml" or fmt.scale_dtype in ("e8m0", "e4m3")  # ggml: raw block headers
        want_dtype = torch.uint8 if byte_scales else _TORCH_SCALE[fmt.scale_dtype]
        if self.scales.dtype != want_dtype:
            raise FormatError(f"{name}: scales stored as {self.scales.dtype}, format {fmt.spec} stores "
                              f"{fmt.scale_dtype} ({want_dtype}); the file was altered")
        if not all_finite(self.scale_values()):
            raise FormatError(f"{name}: scales hold NaN or inf values; the file is damaged")
        if (self.zeros is None) != fmt.symmetric:
            raise FormatError(f"{name}: zero points {'missing' if fmt.symmetric is False else 'unexpected'} "
                              f"for format {fmt.spec}")
        if fmt.float_zeros and self.zeros is not None and (
                tuple(self.zeros.shape) != want_scales or self.zeros.dtype != _TORCH_SCALE[fmt.zero_dtype]):
            raise FormatError(f"{name}: zero points {tuple(self.zeros.shape)} {self.zeros.dtype} do not match shape "
                              f"{self.shape} in format {fmt.spec} (expected {want_scales} {fmt.zero_dtype})")
        if fmt.tensor_scale and self.tensor_scale is None:
            raise FormatError(f"{name}: format {fmt.spec} needs a tensor scale")
        for key in ("zeros", "tensor_scale"):
            t = getattr(self, key)
            if t is not None and t.is_floating_point() and not all_finite(t):
                raise FormatError(f"{name}: {key} hold NaN or inf values; the file is damaged")


def quantize_tensor(x: torch.Tensor, spec: str | Format, name: str = "tensor") -> QuantizedTensor:
    """Round-to-nearest quantise `x` into `spec`; groups run along the last dimension.

    Raises FormatError naming `name`, the shape and the format for an empty tensor, a group size that
    does not divide the last dimension, or NaN/inf values.
    """
    fmt = parse_format(spec)
    shape = tuple(x.shape)
    fmt.check_shape(shape, name)
    if not x.is_floating_point():
        raise FormatError(f"{name}: expected a floating-point tensor, got {x.dtype} (format {fmt.spec})")
    if not all_finite(x):
        n_bad = int((~torch.isfinite(x)).sum())
        raise FormatError(f"{name}: shape {shape} has {n_bad} NaN or inf values; cannot quantise to {fmt.spec}")
    if not fmt.is_quantized:
        return QuantizedTensor(x.detach().to(_FLOAT_DTYPES[fmt.element]).contiguous(), None, None, None, shape, fmt)
    w2d = as_2d(x.detach())
    ts = nvfp4_tensor_scale(w2d) if fmt.tensor_scale else None
    try:
        codes, scale, zero = round_to_nearest(w2d, fmt, ts)
    except ScaleRangeError as exc:  # the scale check does not know the tensor's name
        raise ScaleRangeError(f"{name}: {exc}") from None
    return QuantizedTensor.from_codes(codes, scale, zero, fmt, shape, ts)


# ---------------------------------------------------------------------- files
def save_quantized(path: str | os.PathLike, tensors: dict[str, QuantizedTensor],
                   extra_meta: dict[str, Any] | None = None) -> None:
    """Write quantised tensors to one safetensors file, atomically (`fewbits.files`); replaces a regular file."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    meta = {name: qt.meta() for name, qt in tensors.items()}
    for name, qt in tensors.items():
        for k, v in qt.state_dict(f"{name}.").items():
            flat[k] = v.contiguous()
    header = {"fewbits": json.dumps({"version": FILE_VERSION, "tensors": meta, "extra": extra_meta or {}})}
    write_file(path, lambda tmp: save_file(flat, str(tmp), metadata=header), overwrite=True)


def load_quantized(path: str | os.PathLike) -> dict[str, QuantizedTensor]:
    """Read a file written by `save_quantized`; errors name the file and the tensor that is wrong."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such quantised tensor file")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get("fewbits")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a truncated/corrupt file
        raise FormatError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())[:300]})") from e
    if header is None:
        raise FormatError(f"{path}: no fewbits metadata; not written by fewbits")
    try:
        meta = json.loads(header)
    except (ValueError, RecursionError):
        raise FormatError(f"{path}: the fewbits metadata is not valid JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        raise FormatError(f"{path}: the fewbits metadata is not an object with a \"tensors\" table")
    if meta.get("version") != FILE_VERSION:
        raise FormatError(f"{path}: file version {meta.get('version')!r} is not supported (reads {FILE_VERSION})")
    out = {}
    for name, m in meta["tensors"].items():
        try:
            out[name] = QuantizedTensor.from_state_dict(tensors, f"{name}.", m)
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{path}: tensor {name}: malformed description ({type(e).__name__}: {e})") from None
    return out
