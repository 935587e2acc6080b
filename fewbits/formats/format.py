"""What numbers are stored: the `Format` value and the spec strings users type.

This module is pure Python (no torch, no numpy) so that the cost model can import it.

Spec grammar (canonical spellings; `parse_format(f.spec) == f` for every format):

    bf16 | fp16 | fp32                         no quantisation
    int{2..8}[-t|-g{N}][-asym|-narrow][-s{dtype}][-z{dtype}]
                                               integer codes; default one scale per output channel;
                                               -narrow: symmetric codes -L..L only (see below);
                                               -z{fp16|bf16|fp32} (with -asym): floating zero points
    fp8-e4m3 | fp8-e5m2 [-t|-g{N}][-s{dtype}]  OCP 8-bit floats with a high-precision scale
    fp4-g{N} | nf4-g{N} [-s{dtype}]            E2M1 / NormalFloat-4 codes, one scale per group
    mxfp4 | mxfp8                              OCP MX: blocks of 32, power-of-two E8M0 scale
    nvfp4                                      blocks of 16, E4M3 scale, plus one FP32 tensor scale
    q4_0 | q4_1 | q5_0 | q5_1 | q8_0 | q4_k | q5_k | q6_k
                                               llama.cpp's block types, stored as GGUF stores them
                                               (formats/ggml_types.py)

Granularity refers to a weight of shape (out_features, in_features): "channel" is one scale per
row, "group" is one scale per `group_size` consecutive values along the input (last) dimension,
"tensor" is one scale for everything.

Zero points of asymmetric integer formats are integers in [0, 2^b - 1] packed with the code width by
default.  `-zfp16` (or -zbf16, -zfp32) stores them as one float per group instead, so a method can put
the grid anywhere (HQQ optimises it; GGUF's Q4_1 keeps a 16-bit "min" the same way): the decoded value
is w = (c - z) * s for code c, scale s and float zero z, and each zero costs 16 (or 32) bits.

The grid of symmetric integer codes.  "full" (the default): all 2^b codes -2^(b-1)..2^(b-1)-1, the
group's extreme value of either sign on the end code -2^(b-1) (scale s = x_extreme / -2^(b-1), so the
scale is negative when the extreme is positive and the other sign reaches at most 2^(b-1)-1 steps); this is
llama.cpp's Q4_0 (d = max / -8) and compressed-tensors' symmetric int4 (-8..7).  "narrow" (`-narrow`):
the textbook absmax grid -L..L, L = 2^(b-1)-1, s = max|x| / L (codes -7..7 at 4 bits, one code unused);
GGUF's Q8_0 and the grid of fewbits before the full grid.  Both store code c = q + 2^(b-1) and decode
w = (c - 2^(b-1)) * s, so the stored bits per weight are the same.  The full grid is the default because
it measured better (benchmarks/bench_methods.py, mean KL to the float model, narrow -> full): SmolLM2-135M
int4-g64 RTN 0.538 -> 0.304, GPTQ 0.176 -> 0.131; int4-g32 RTN 0.364 -> 0.265, GPTQ 0.144 -> 0.107;
int3-g64 RTN 2.43 -> 1.25, GPTQ 1.10 -> 0.54; int8 RTN 0.0030 -> 0.0028; Gemma-3-270M int4-g128 RTN
0.699 -> 0.572.

Metadata versions: version 1 dicts have no zero dtype (integer zeros) and no grid; version 2 adds
"zero_dtype" (floating zeros); version 3 adds "grid".  `to_dict` writes version 3 (with "grid") for every
symmetric integer format, version 2 for floating zeros and version 1 for everything else.  A version 1 or 2
dict of a symmetric integer format was written before the full grid existed: it reads as the narrow grid,
its "spec" spelled without `-narrow` (the spelling of that time).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from fewbits.formats.ggml_types import GGML_TYPES

FORMAT_VERSION = 3
#: metadata versions `Format.from_dict` reads
READABLE_VERSIONS = (1, 2, 3)

Kind = Literal["float", "int", "fp8", "fp4", "nf4", "mxfp4", "mxfp8", "nvfp4", "ggml"]
Granularity = Literal["none", "tensor", "channel", "group"]

#: storage bits of each scale dtype
SCALE_BITS = {"fp64": 64, "fp32": 32, "fp16": 16, "bf16": 16, "e8m0": 8, "e4m3": 8}
#: element encodings of the floating kinds (exponent bits, mantissa bits)
FLOAT_KINDS = {"bf16": 16, "fp16": 16, "fp32": 32}
ELEMENTS = {"e4m3", "e5m2"}
#: storage bits of each floating zero-point dtype ("int": integer zeros packed with the code width)
ZERO_BITS = {"fp32": 32, "fp16": 16, "bf16": 16}
#: grids of symmetric integer codes (module docstring); the first is the default
GRIDS = ("full", "narrow")


class FormatError(ValueError):
    """A format spec or a tensor/format combination that cannot work."""


@dataclass(frozen=True)
class Format:
    """One storage format.  Immutable; round-trips through `spec` and `to_dict`.

    kind: "float" (bf16/fp16/fp32, unquantised), "int", "fp8", "fp4", "nf4", "mxfp4", "mxfp8", "nvfp4".
    bits: bits per stored code (16/32 for floats).
    granularity: "none" for floats, else "tensor", "channel" or "group".
    group_size: values per scale along the last dimension when granularity == "group".
    symmetric: False for min-max codes with a zero point (integer formats only).
    scale_dtype: "fp16", "bf16", "fp32", "e8m0" (MX) or "e4m3" (NVFP4).
    element: "int", "e4m3", "e5m2", "e2m1", "nf4", or the float name for unquantised formats.
    tensor_scale: an extra FP32 scale for the whole tensor (NVFP4).
    zero_dtype: "int" (zero points are integers packed with the code width) or "fp16"/"bf16"/"fp32"
        (one float zero point per group, asymmetric integer formats only).
    grid: "full" (codes -2^(b-1)..2^(b-1)-1, the default) or "narrow" (-L..L, L = 2^(b-1)-1); "narrow"
        applies to symmetric integer formats only (the others use every code already).
    """

    kind: Kind
    bits: int
    granularity: Granularity = "channel"
    group_size: int = 0
    symmetric: bool = True
    scale_dtype: str = "fp16"
    element: str = "int"
    tensor_scale: bool = False
    zero_dtype: str = "int"
    grid: str = "full"

    def __post_init__(self) -> None:
        if self.kind == "int" and not 2 <= self.bits <= 8:
            raise FormatError(f"integer formats take 2..8 bits, got {self.bits}")
        if self.granularity == "group" and self.group_size <= 0:
            raise FormatError(f"group size must be positive, got {self.group_size}")
        if self.scale_dtype not in SCALE_BITS:
            raise FormatError(f"unknown scale dtype {self.scale_dtype!r}; one of {sorted(SCALE_BITS)}")
        if not self.symmetric and self.kind != "int":
            raise FormatError(f"-asym applies to integer formats only, not {self.kind}")
        if self.zero_dtype != "int":
            if self.zero_dtype not in ZERO_BITS:
                raise FormatError(f"unknown zero-point dtype {self.zero_dtype!r}; 'int' or one of {sorted(ZERO_BITS)}")
            if self.kind != "int" or self.symmetric:
                raise FormatError(f"floating zero points (-z{self.zero_dtype}) need an asymmetric integer "
                                  f"format (e.g. int4-g64-asym-z{self.zero_dtype}), not {self.kind} "
                                  f"{'symmetric' if self.symmetric else ''}".rstrip())
        if self.grid not in GRIDS:
            raise FormatError(f"unknown grid {self.grid!r}; one of {', '.join(GRIDS)}")
        if self.grid == "narrow" and not self.sym_int:
            raise FormatError(f"the narrow grid (-narrow) applies to symmetric integer formats, not "
                              f"{'asymmetric ' if self.kind == 'int' else ''}{self.kind}")

    # ------------------------------------------------------------------ naming
    @property
    def is_quantized(self) -> bool:
        return self.kind != "float"

    @property
    def sym_int(self) -> bool:
        """True for symmetric integer formats, the ones that have a grid to choose (`grid`)."""
        return self.kind == "int" and self.symmetric

    @property
    def qmin(self) -> int:
        """Lowest rounded value q of an integer code (stored as q + 2^(b-1) when symmetric, as is when not)."""
        if not self.symmetric:
            return 0
        return -(2 ** (self.bits - 1)) + (self.grid == "narrow")

    @property
    def qmax(self) -> int:
        """Highest rounded value q of an integer code (see `qmin`)."""
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    @property
    def float_zeros(self) -> bool:
        """True when zero points are stored as floats (`-zfp16` etc.), not as packed integers."""
        return self.zero_dtype != "int"

    @property
    def default_scale_dtype(self) -> str:
        return {"fp8": "fp32", "mxfp4": "e8m0", "mxfp8": "e8m0", "nvfp4": "e4m3"}.get(self.kind, "fp16")

    @property
    def spec(self) -> str:
        """The canonical spec string; `parse_format(self.spec) == self`."""
        if self.kind == "float":
            return self.element
        if self.kind in ("mxfp4", "mxfp8", "nvfp4"):
            return self.kind
        if self.kind == "ggml":
            return self.element
        base = {"int": f"int{self.bits}", "fp8": f"fp8-{self.element}", "fp4": "fp4", "nf4": "nf4"}[self.kind]
        parts = [base]
        if self.granularity == "tensor":
            parts.append("t")
        elif self.granularity == "group":
            parts.append(f"g{self.group_size}")
        if not self.symmetric:
            parts.append("asym")
        if self.grid != "full":
            parts.append(self.grid)
        if self.scale_dtype != self.default_scale_dtype:
            parts.append(f"s{self.scale_dtype}")
        if self.zero_dtype != "int":
            parts.append(f"z{self.zero_dtype}")
        return "-".join(parts)

    def __str__(self) -> str:
        return self.spec

    # ------------------------------------------------------------------ sizes
    def groups_per_row(self, in_features: int) -> int:
        """Scales per row of a weight with `in_features` columns (1 per-channel, 0 per-tensor)."""
        if self.granularity == "group":
            return in_features // self.group_size
        if self.granularity == "channel":
            return 1
        return 0

    def check_shape(self, shape: tuple[int, ...], name: str = "tensor") -> None:
        """Raise FormatError naming `name`, the shape and the format when they do not fit."""
        if len(shape) == 0 or any(d <= 0 for d in shape):
            raise FormatError(f"{name}: shape {tuple(shape)} is empty; format {self.spec} needs at least one value")
        if self.granularity == "group" and shape[-1] % self.group_size:
            raise FormatError(
                f"{name}: last dimension {shape[-1]} of shape {tuple(shape)} is not divisible by the "
                f"group size {self.group_size} of format {self.spec}"
            )

    def storage_bits(self, shape: tuple[int, ...]) -> int:
        """Exact bits stored for a tensor of `shape`: codes + scales + zero points (+ tensor scale).

        Codes are packed row by row (rows padded to whole bytes), as `QuantizedTensor` stores them.
        """
        self.check_shape(shape)
        numel = math.prod(shape)
        if self.kind == "float":
            return numel * self.bits
        cols = shape[-1]
        rows = numel // cols
        if self.kind == "ggml":  # whole GGUF blocks: header + codes
            return rows * (cols // self.group_size) * GGML_TYPES[self.element].block_bytes * 8
        code_bits = rows * (-(-cols * self.bits // 8) * 8)
        n_scales = 1 if self.granularity == "tensor" else rows * self.groups_per_row(cols)
        scale_bits = n_scales * SCALE_BITS[self.scale_dtype]
        zero_bits = 0
        if self.float_zeros:  # one float per scale
            zero_bits = n_scales * ZERO_BITS[self.zero_dtype]
        elif not self.symmetric:  # zero points are packed with the code width, row by row
            zeros_per_row = self.groups_per_row(cols)
            zero_bits = 8 * -(-self.bits // 8) if self.granularity == "tensor" else rows * (
                -(-zeros_per_row * self.bits // 8) * 8)
        extra = 32 if self.tensor_scale else 0
        return code_bits + scale_bits + zero_bits + extra

    def bits_per_weight(self, shape: tuple[int, ...] | None = None) -> float:
        """Average stored bits per value for `shape`, scales and zero points included.

        Without a shape, the asymptotic figure for a large matrix: per-tensor and per-channel
        scales (and the NVFP4 tensor scale) are then negligible.  `int4-g128` gives 4.125.
        """
        if shape is not None:
            return self.storage_bits(tuple(shape)) / math.prod(shape)
        if self.kind == "float":
            return float(self.bits)
        if self.kind == "ggml":
            return GGML_TYPES[self.element].bits_per_weight
        bpw = float(self.bits)
        if self.granularity == "group":
            bpw += SCALE_BITS[self.scale_dtype] / self.group_size
            if self.float_zeros:
                bpw += ZERO_BITS[self.zero_dtype] / self.group_size
            elif not self.symmetric:
                bpw += self.bits / self.group_size
        return bpw

    def bytes_per_weight(self, shape: tuple[int, ...] | None = None) -> float:
        return self.bits_per_weight(shape) / 8

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of `shape` occupies in this format."""
        return -(-self.storage_bits(tuple(shape)) // 8)

    # ------------------------------------------------------------------ metadata
    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields: version 3 (with "grid") for symmetric integer formats, version 2 (with
        "zero_dtype") for floating zeros, version 1 for the rest (module docstring)."""
        d: dict[str, Any] = {
            "version": 3 if self.sym_int else 2 if self.float_zeros else 1,
            "spec": self.spec,
            "kind": self.kind,
            "bits": self.bits,
            "granularity": self.granularity,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "scale_dtype": self.scale_dtype,
            "element": self.element,
            "tensor_scale": self.tensor_scale,
        }
        if self.float_zeros:
            d["zero_dtype"] = self.zero_dtype
        if self.sym_int:
            d["grid"] = self.grid
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Format:
        version = d.get("version")
        if version not in READABLE_VERSIONS:
            raise FormatError(f"format metadata version {version!r} is not supported "
                              f"(this fewbits reads {', '.join(map(str, READABLE_VERSIONS))})")
        if version == 1 and "zero_dtype" in d:
            raise FormatError("format metadata version 1 cannot carry 'zero_dtype' (written as version 2)")
        if version < 3 and "grid" in d:
            raise FormatError(f"format metadata version {version} cannot carry 'grid' (written as version 3)")
        fields = {k: d[k] for k in ("kind", "bits", "granularity", "group_size", "symmetric",
                                    "scale_dtype", "element", "tensor_scale", "zero_dtype", "grid") if k in d}
        legacy = version < 3 and fields.get("kind") == "int" and fields.get("symmetric", True)
        if legacy:  # written before the full grid existed: the narrow grid, spelled without -narrow
            fields["grid"] = "narrow"
        fmt = cls(**fields)
        spelled = replace(fmt, grid="full").spec if legacy else fmt.spec
        if "spec" in d and d["spec"] != spelled:
            raise FormatError(f"format metadata is inconsistent: spec {d['spec']!r} but fields give {spelled!r}")
        return fmt

    def with_group(self, group_size: int) -> Format:
        """The same format with another group size (used to regroup layers that do not divide)."""
        if self.granularity != "group":
            raise FormatError(f"format {self.spec} has no groups")
        return replace(self, group_size=group_size)

    def regrouped(self, in_features: int) -> Format | None:
        """The format a weight with `in_features` columns gets under the "regroup" misfit policy: itself
        when it fits, else the same format with the largest group size <= its own that divides in_features
        (576 columns, int4-g128 -> int4-g96); None when the block size is part of the format (mxfp4,
        mxfp8, nvfp4), which cannot be regrouped.  Quantisation (`Recipe`) and the cost model share it."""
        if self.granularity != "group" or in_features % self.group_size == 0:
            return self
        if self.kind in FIXED_BLOCK_KINDS:
            return None
        return self.with_group(largest_dividing_group(in_features, self.group_size))


#: what a layer whose width a format's group size does not divide gets: an error, its 16-bit weights, or the
#: largest group size that divides (`Format.regrouped`)
MISFIT_POLICIES: tuple[str, ...] = ("error", "keep", "regroup")
#: formats whose block size is part of the format itself (cannot be regrouped)
FIXED_BLOCK_KINDS = frozenset({"mxfp4", "mxfp8", "nvfp4", "ggml"})


def largest_dividing_group(cols: int, requested: int) -> int:
    """The largest group size <= `requested` that divides `cols` (576 columns, 128 asked -> 96)."""
    return next(g for g in range(min(requested, cols), 0, -1) if cols % g == 0)


# ---------------------------------------------------------------------- parsing
_SUFFIX = re.compile(r"^(t|g(\d+)|asym|full|narrow|s(fp64|fp32|fp16|bf16)|z(fp32|fp16|bf16))$")


def parse_format(spec: str | Format) -> Format:
    """Parse a spec string such as ``int4-g128``, ``int8-asym``, ``fp8-e4m3``, ``nvfp4``."""
    if isinstance(spec, Format):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise FormatError(f"empty format spec {spec!r}")
    s = spec.strip().lower()
    if s in FLOAT_KINDS:
        return Format("float", FLOAT_KINDS[s], "none", 0, True, "fp16" if s != "fp32" else "fp32", s)
    if s == "mxfp4":
        return Format("mxfp4", 4, "group", 32, True, "e8m0", "e2m1")
    if s == "mxfp8":
        return Format("mxfp8", 8, "group", 32, True, "e8m0", "e4m3")
    if s == "nvfp4":
        return Format("nvfp4", 4, "group", 16, True, "e4m3", "e2m1", tensor_scale=True)
    if s in GGML_TYPES:  # one scale dtype, block and header per type: no suffixes
        t = GGML_TYPES[s]
        return Format("ggml", t.bits, "group", t.block, True, "fp16", t.name)
    m = re.match(r"^(int(\d+)|fp8-(e4m3|e5m2)|fp4|nf4)((?:-[a-z0-9]+)*)$", s)
    if not m:
        raise FormatError(f"unknown format {spec!r}; " + _hint(s))
    head, int_bits, fp8_elem, rest = m.group(1), m.group(2), m.group(3), m.group(4)
    if int_bits is not None:
        kind, bits, element = "int", int(int_bits), "int"
        if not 2 <= bits <= 8:
            raise FormatError(f"format {spec!r}: integer formats take 2..8 bits, got {bits}")
    elif fp8_elem is not None:
        kind, bits, element = "fp8", 8, fp8_elem
    else:
        kind, bits, element = head, 4, "e2m1" if head == "fp4" else "nf4"
    granularity, group, symmetric, zero_dtype, grid = "channel", 0, True, "int", "full"
    scale_dtype = "fp32" if kind == "fp8" else "fp16"
    seen: set[str] = set()
    for part in [p for p in rest.split("-") if p]:
        sm = _SUFFIX.match(part)
        key = part if part in ("asym", "full", "narrow") else part[0]
        if part in ("full", "narrow"):
            key = "grid"
        if not sm or key in seen or (key in "tg" and ("t" in seen or "g" in seen)):
            raise FormatError(f"format {spec!r}: cannot read the suffix {part!r}; " + _hint(s))
        seen.add(key)
        if part == "t":
            granularity = "tensor"
        elif part == "asym":
            symmetric = False
        elif key == "grid":
            grid = part
        elif sm.group(2):
            granularity, group = "group", int(sm.group(2))
            if group <= 0:
                raise FormatError(f"format {spec!r}: group size must be positive")
        elif sm.group(4):
            zero_dtype = sm.group(4)
        else:
            scale_dtype = sm.group(3)
    if kind in ("fp4", "nf4") and granularity != "group":
        raise FormatError(f"format {spec!r}: {kind} needs a group size, e.g. {kind}-g64")
    if not symmetric and kind != "int":
        raise FormatError(f"format {spec!r}: -asym applies to integer formats only")
    if zero_dtype != "int" and (kind != "int" or symmetric):
        raise FormatError(f"format {spec!r}: floating zero points (-z{zero_dtype}) need an asymmetric integer "
                          f"format, e.g. int4-g64-asym-z{zero_dtype}")
    if "grid" in seen and not (kind == "int" and symmetric):
        raise FormatError(f"format {spec!r}: -{grid} chooses the grid of symmetric integer codes; "
                          f"{'-asym uses all codes already' if kind == 'int' else kind + ' has no such grid'}")
    return Format(kind, bits, granularity, group, symmetric, scale_dtype, element, zero_dtype=zero_dtype, grid=grid)


#: the formats `fewbits formats` lists (every spec the grammar accepts works as well)
EXAMPLE_SPECS = (
    "fp32", "bf16", "fp16",
    "int8", "int8-t", "int8-g128", "int8-asym",
    "int4", "int4-g128", "int4-g64", "int4-g32", "int4-g64-narrow", "int4-g128-asym", "int4-g64-asym-zfp16",
    "int3-g128", "int3-g64", "int2-g64", "int2-g32-asym",
    "fp8-e4m3", "fp8-e4m3-t", "fp8-e5m2",
    "fp4-g32", "nf4-g64", "mxfp4", "mxfp8", "nvfp4",
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
)


def _hint(s: str) -> str:
    import difflib

    close = difflib.get_close_matches(s, EXAMPLE_SPECS, n=3, cutoff=0.5)
    tail = f"did you mean {', '.join(close)}? " if close else ""
    return tail + "examples: int4-g128, int8, int4-g64-asym, fp8-e4m3, nf4-g64, mxfp4, nvfp4, bf16"
