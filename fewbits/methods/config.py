"""Typed options of every quantisation method: one frozen dataclass per method.

A config holds what a user may choose for a method (fields with types and defaults) and says which
formats the method takes (class attributes).  It is pure Python (no torch), so a recipe can be read and
checked, and `fewbits quantize --help` listed, without loading torch.  A misspelled or wrongly typed
option is an error naming it and the valid ones (house rule 4), never silently ignored:

    >>> HQQ.from_options({"iter": 5}, "hqq")
    Traceback (most recent call last):
    MethodConfigError: method hqq has no option 'iter'; its options are beta, iters, kappa, p

Configs round-trip through plain dicts (`options()` gives the fields that differ from the defaults, as a
recipe rule stores them; `to_dict()` every field, as a report records them).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

from fewbits.formats.format import Format

#: format kinds the integer-code methods take
INT_KINDS = frozenset({"int"})
ALL_KINDS = frozenset({"int", "fp8", "fp4", "nf4", "mxfp4", "mxfp8", "nvfp4", "ggml"})


#: an expert's linear is calibrated from at least this many routed tokens per input feature, else RTN: the
#: least data for which its Hessian can have full rank
EXPERT_MIN_TOKENS = 1.0


class MethodConfigError(ValueError):
    """A method option that does not exist, has the wrong type or lies outside its range; or a format the
    method does not take."""


@dataclass(frozen=True)
class MethodConfig:
    """A method without options (also the config of a plugged-in method: it checks its own formats)."""

    #: the method's name in `fewbits.methods.registry.METHODS` ("" for the shared no-option config)
    method: ClassVar[str] = ""
    #: format kinds the method takes (None: any; a plugged-in method checks its own) and, in words, which
    kinds: ClassVar[frozenset[str] | None] = None
    takes: ClassVar[str] = "any quantised format"
    #: whether floating zero points (-zfp16 formats) suit the method's rounding
    float_zeros: ClassVar[bool] = True
    #: only 8-bit per-channel integer weights (the W8A8 methods)
    int8_channel_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, _typed(self._label(), f.name, hints[f.name], getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Range checks of a method's fields (MethodConfigError naming the field)."""

    # ------------------------------------------------------------------ options as plain data
    @classmethod
    def option_names(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], method: str | None = None) -> MethodConfig:
        """The config for `options` ({name: value}, e.g. a recipe rule's table); unknown names are an error
        listing the valid ones."""
        label = method or cls.method or "this method"
        if not isinstance(options, Mapping):
            raise MethodConfigError(f"options of method {label} must be a table of named values, "
                                    f"got {type(options).__name__}")
        valid = cls.option_names()
        unknown = [str(k) for k in options if k not in valid]
        if unknown:
            listed = f"its options are {', '.join(valid)}" if valid else "it takes no options"
            raise MethodConfigError(f"method {label} has no option{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(map(repr, unknown))}; {listed}")
        return cls(**options)

    def options(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a recipe rule stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != _default(f)}

    def to_dict(self) -> dict[str, Any]:
        """Every field, with the method's name (what a report records)."""
        return {"method": self.method, **asdict(self)}

    # ------------------------------------------------------------------ formats
    def format_problem(self, fmt: Format, name: str | None = None) -> str | None:
        """Why the method (called `name`; default its own name) cannot quantise into `fmt`, or None."""
        name = name or self.method or "this method"
        if not fmt.is_quantized:
            return f"method {name} needs a quantised format, got {fmt.spec}"
        if self.kinds is not None and fmt.kind not in self.kinds:
            return f"method {name} does not work with format {fmt.spec}: it takes {self.takes}"
        if self.int8_channel_only and (fmt.bits != 8 or fmt.granularity != "channel"):
            return f"method {name} does not work with format {fmt.spec}: it takes {self.takes}"
        if fmt.float_zeros and not self.float_zeros:
            plain = fmt.spec.replace(f"-z{fmt.zero_dtype}", "")
            return (f"method {name} does not work with format {fmt.spec}: floating zero points "
                    f"(-z{fmt.zero_dtype}) suit only methods whose rounding keeps them (rtn, hqq, awq); "
                    f"use {plain} (integer zero points) with {name}")
        return None

    def _label(self) -> str:
        return f"method {self.method}" if self.method else type(self).__name__


def _default(f: Any) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def _typed(label: str, name: str, kind: Any, value: Any) -> Any:
    """`value` checked against the field's type (bool, int or float; an int is accepted as a float)."""
    if kind is bool:
        if not isinstance(value, bool):
            raise MethodConfigError(f"{label} option {name} must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MethodConfigError(f"{label} option {name} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise MethodConfigError(f"{label} option {name} must be a number, got {value!r}")
        return float(value)
    raise TypeError(f"{label}: option {name} has type {kind}; method options are bool, int or float")


def _at_least(cfg: MethodConfig, name: str, low: float, strict: bool = False) -> None:
    v = getattr(cfg, name)
    if v < low or (strict and v == low) or math.isinf(v):
        raise MethodConfigError(f"{cfg._label()} option {name} must be {'above' if strict else 'at least'} {low} "
                                f"(and finite), got {v!r}")


# ---------------------------------------------------------------------- the methods
@dataclass(frozen=True)
class RTN(MethodConfig):
    """Round to nearest: every format, no options, no data."""

    method: ClassVar[str] = "rtn"
    kinds: ClassVar[frozenset[str] | None] = ALL_KINDS


@dataclass(frozen=True)
class GPTQ(MethodConfig):
    """GPTQ (Frantar et al. 2022): damping as a fraction of the mean Hessian diagonal, activation order
    (columns with the largest Hessian diagonal first; the default, as in the reference code's best
    results), lazy block width, and group scales from the original weights (static groups)."""

    method: ClassVar[str] = "gptq"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS | {"ggml"}
    takes: ClassVar[str] = "integer formats (int2..int8, any grouping, sym or asym) and llama.cpp's block types " \
                           "(q4_0 ... q8_0, q4_k, q5_k, q6_k)"
    float_zeros: ClassVar[bool] = False  # the column loop rounds on an integer grid: round(w / s) + z

    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    static_groups: bool = False
    #: a mixture-of-experts expert whose router sent it fewer calibration tokens than this x its input
    #: width falls back to round-to-nearest (`fewbits.calib.moe`); dense layers ignore it
    expert_min_tokens: float = EXPERT_MIN_TOKENS

    def check(self) -> None:
        _at_least(self, "damp", 0.0)
        _at_least(self, "block_size", 1)
        _at_least(self, "expert_min_tokens", 0.0)

    def gptq_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `fewbits.methods.gptq.gptq_quantize`."""
        return {"damp": self.damp, "act_order": self.act_order, "block_size": self.block_size,
                "static_groups": self.static_groups}


@dataclass(frozen=True)
class AWQ(MethodConfig):
    """AWQ (Lin et al. 2023): points of the exponent grid searched for the scales, whether clipping is
    searched too, and how many calibration tokens each search sees (a CPU budget)."""

    method: ClassVar[str] = "awq"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS
    takes: ClassVar[str] = "integer formats (int2..int8, any grouping, sym or asym)"

    grid: int = 20
    clip: bool = True
    search_tokens: int = 512
    clip_tokens: int = 128
    expert_min_tokens: float = EXPERT_MIN_TOKENS  # as GPTQ's

    def check(self) -> None:
        for name in ("grid", "search_tokens", "clip_tokens"):
            _at_least(self, name, 1)
        _at_least(self, "expert_min_tokens", 0.0)


@dataclass(frozen=True)
class AWQGPTQ(GPTQ):
    """AWQ scales folded into the model (no clipping), then GPTQ on the scaled weights."""

    method: ClassVar[str] = "awq+gptq"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS  # as AWQ's search
    takes: ClassVar[str] = "integer formats (int2..int8, any grouping, sym or asym)"

    grid: int = 20
    search_tokens: int = 512

    def check(self) -> None:
        super().check()
        _at_least(self, "grid", 1)
        _at_least(self, "search_tokens", 1)


@dataclass(frozen=True)
class HQQ(MethodConfig):
    """HQQ (Badri & Shaji 2023): half-quadratic iterations, the lp-norm exponent p of the error, the
    penalty beta and its growth factor kappa per iteration."""

    method: ClassVar[str] = "hqq"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS
    takes: ClassVar[str] = "integer formats, best with float zero points (e.g. int4-g64-asym-zfp16)"

    iters: int = 20
    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01

    def check(self) -> None:
        _at_least(self, "iters", 1)
        _at_least(self, "p", 0.0, strict=True)
        _at_least(self, "beta", 0.0, strict=True)
        _at_least(self, "kappa", 1.0)


@dataclass(frozen=True)
class SmoothQuant(MethodConfig):
    """SmoothQuant (Xiao et al. 2023) W8A8: migration strength alpha, whether to smooth at all (off: the
    plain W8A8 baseline), and the bits of the per-token activation codes."""

    method: ClassVar[str] = "smoothquant"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS
    takes: ClassVar[str] = "8-bit per-channel integer weights (int8)"
    float_zeros: ClassVar[bool] = False
    int8_channel_only: ClassVar[bool] = True

    alpha: float = 0.5
    smooth: bool = True
    act_bits: int = 8

    def check(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise MethodConfigError(f"method smoothquant option alpha must lie in [0, 1], got {self.alpha!r}")
        if not 2 <= self.act_bits <= 8:
            raise MethodConfigError(f"method smoothquant option act_bits must be 2..8, got {self.act_bits!r}")


@dataclass(frozen=True)
class LLMInt8(MethodConfig):
    """LLM.int8() (Dettmers et al. 2022): input dimensions with |x| >= threshold run in 16 bits."""

    method: ClassVar[str] = "llm-int8"
    kinds: ClassVar[frozenset[str] | None] = INT_KINDS
    takes: ClassVar[str] = "8-bit per-channel integer weights (int8)"
    float_zeros: ClassVar[bool] = False
    int8_channel_only: ClassVar[bool] = True

    threshold: float = 6.0

    def check(self) -> None:
        if not self.threshold > 0:
            raise MethodConfigError(f"method llm-int8 option threshold must be above 0, got {self.threshold!r}")


__all__ = ["MethodConfig", "MethodConfigError", "RTN", "GPTQ", "AWQ", "AWQGPTQ", "HQQ", "SmoothQuant", "LLMInt8"]
