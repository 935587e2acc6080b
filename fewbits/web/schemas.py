"""The web API's request bodies: every field typed, bounded and named in the error when it is wrong.

Bounds keep one request cheap (the cost model is closed-form, but a 10^12 batch or a 50 MB config is
refused before any work): batch <= 65,536, context <= 10^7 tokens, 1,024 devices, a config.json of at most
2,000 entries, 64 pasted weights of magnitude 1e-6 to 1,000 (or 0).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
SPEC = r"^[a-z0-9][a-z0-9-]{0,39}$"
MAX_CONFIG_ENTRIES = 2000
MAX_DIM = 100_000_000
#: the config.json fields the cost model reads as sizes: at least 1 (the first group) or 0 (the others)
POSITIVE = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
COUNTS = ("num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "max_position_embeddings")


def _check_sizes(cfg: dict[str, Any], where: str = "config") -> None:
    """Sizes must be integers in range, so that a strange upload is a message, not a division by zero."""
    if "model_type" in cfg and not isinstance(cfg["model_type"], str):
        raise ValueError(f"{where} field 'model_type' must be a string, got {str(cfg['model_type'])[:40]}")
    for key in POSITIVE + COUNTS:
        v = cfg.get(key)
        if v is None:
            continue
        low = 1 if key in POSITIVE else 0
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_DIM:
            raise ValueError(f"{where} field {key!r} must be an integer from {low} to {MAX_DIM:,}, got {str(v)[:40]}")
    if isinstance(cfg.get("text_config"), dict):
        _check_sizes(cfg["text_config"], f"{where}.text_config")


def _count(x: Any, depth: int = 0) -> int:
    if depth > 6:
        raise ValueError("config is nested too deeply (at most 6 levels)")
    if isinstance(x, dict):
        return len(x) + sum(_count(v, depth + 1) for v in x.values())
    if isinstance(x, list):
        return len(x) + sum(_count(v, depth + 1) for v in x)
    return 0



def _check_specs(v: list[str]) -> list[str]:
    """Each entry spelled like a format spec (the library parses it; this bounds what reaches it)."""
    for s in v:
        if not re.match(SPEC, s):
            raise ValueError(f"{s[:40]!r} is not a format spec")
    return v

class PlanRequest(BaseModel):
    """One state of the decode explorer (the options of `fewbits plan`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("llama-3-8b", pattern=NAME, description="a preset name (ignored when `config` is given)")
    config: dict[str, Any] | None = Field(None, description="the fields of a Hugging Face config.json")
    config_name: str = Field("config.json", pattern=NAME, description="the dropped file's name")
    device: str = Field("h100", pattern=NAME)
    weights: str = Field("bf16", pattern=SPEC)
    kv: str = Field("bf16", pattern=SPEC)
    batch: int = Field(16, ge=1, le=65536)
    context: int = Field(4096, ge=1, le=10_000_000)
    devices: int = Field(1, ge=1, le=1024)
    profile: str = Field("seed", pattern=NAME)
    table_weights: list[str] = Field(["bf16", "int8", "int4"], min_length=1, max_length=8)
    table_kv: list[str] = Field(["bf16", "fp8-e4m3"], min_length=1, max_length=4)
    sweep_axis: Literal["context", "batch"] = "context"

    @field_validator("table_weights", "table_kv")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        return _check_specs(v)

    @field_validator("config")
    @classmethod
    def _small(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and _count(v) > MAX_CONFIG_ENTRIES:
            raise ValueError(f"config has more than {MAX_CONFIG_ENTRIES} entries; is it a config.json?")
        if v is not None:
            _check_sizes(v)
        return v


class TryRequest(BaseModel):
    """64 weights through one quantiser (the options of `fewbits try`)."""

    model_config = ConfigDict(extra="forbid")

    family: Literal["int", "fp8-e4m3", "fp8-e5m2", "fp4", "nf4", "mxfp4", "mxfp8", "nvfp4"] = "int"
    bits: int = Field(4, ge=2, le=8)
    group: Literal[64, 32, 16, 8] = 64
    asym: bool = False
    full_grid: bool = Field(False, description="int: codes -2^(b-1)..2^(b-1)-1 instead of the textbook -L..L")
    outlier: bool = False
    seed: int = Field(0, ge=0, le=2**32 - 1)
    weights: list[float] | None = Field(None, min_length=64, max_length=64,
                                        description="64 pasted weights instead of the seeded ones")

    @field_validator("weights")
    @classmethod
    def _finite(cls, v: list[float] | None) -> list[float] | None:
        # float32 holds them (the quantiser works in float32) and their norm neither overflows nor underflows
        if v is not None and not all(x == 0 or 1e-6 <= abs(x) <= 1000 for x in v):  # also refuses NaN
            raise ValueError("weights must be 0 or of magnitude 1e-6 to 1000")
        return v


class LayerErrorRequest(BaseModel):
    """The one-layer experiment (the options of `fewbits layer-error`)."""

    model_config = ConfigDict(extra="forbid")

    weights: list[str] = Field(["int8", "int4", "int4-g128", "int4-g32", "int3-g128"], min_length=1, max_length=8)
    rows: int = Field(512, ge=8, le=1024)
    cols: int = Field(512, ge=8, le=1024)
    w_std: float = Field(0.02, ge=1e-6, le=10)
    outlier_channel: int | None = Field(7, ge=0, le=1023)
    outlier_value: float = Field(20.0, ge=-1e4, le=1e4)
    threshold: float = Field(6.0, gt=0, le=1e4)
    seed: int = Field(0, ge=0, le=2**32 - 1)

    @field_validator("weights")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        return _check_specs(v)
