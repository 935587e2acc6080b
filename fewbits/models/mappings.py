"""Architecture knowledge as data: where the decoder blocks live, the order of the linears inside a
block, and which module feeds which linears (for folding AWQ / SmoothQuant scales).

Nothing here inspects classes: a family is looked up by the `model_type` of its config, and every
module is named by a path relative to one decoder block.  Adding a family is adding one entry.

A smoothing mapping says: the input of `linears` is the output of `prev` (a norm or a linear), so a
per-input-channel scale `s` can be folded exactly as  prev_out / s  and  W[:, j] * s_j  (AWQ, Lin et
al. 2023, section 3.2; SmoothQuant, Xiao et al. 2022, eq. 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SmoothMapping:
    """`prev` (a path inside the block) produces the input of every path in `linears`."""

    prev: str
    linears: tuple[str, ...]
    prev_kind: str = "norm"  # "norm" (scale its weight) or "linear" (scale its output rows + bias)


@dataclass(frozen=True)
class ArchMapping:
    """How one model family is laid out.

    blocks: regex matching the full name of the module list that holds the decoder blocks.
    sequential: groups of linears (paths inside a block) in the order data flows through them;
        linears of one group see the same input and may be quantised together ("true sequential"
        quantisation quantises group k before collecting statistics for group k+1).
    smooth: the folding opportunities, in data-flow order.
    norm_plus_one: the RMSNorm multiplies by (1 + weight) instead of weight (Gemma families).
    outputs: (module, linear) pairs where the module's output (first element, if it returns a tuple) is
        that linear's output: once everything before the linear is quantised, the calibration can replay
        the module from the linear's recorded input instead of running it again.
    """

    family: str
    blocks: str
    sequential: tuple[tuple[str, ...], ...]
    smooth: tuple[SmoothMapping, ...]
    norm_plus_one: bool = False
    model_types: tuple[str, ...] = field(default_factory=tuple)
    outputs: tuple[tuple[str, str], ...] = (("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj"))

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(p for group in self.sequential for p in group)


_ATTN_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
_SEQUENTIAL = (_ATTN_QKV, ("self_attn.o_proj",), _MLP_IN, ("mlp.down_proj",))

_LLAMA_SMOOTH = (
    SmoothMapping("input_layernorm", _ATTN_QKV),
    SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "linear"),
    SmoothMapping("post_attention_layernorm", _MLP_IN),
    SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "linear"),
)

# Gemma 2/3: the attention output goes through post_attention_layernorm *after* o_proj, and the MLP
# input norm is pre_feedforward_layernorm, so that is the norm that feeds gate/up.
_GEMMA2_SMOOTH = (
    SmoothMapping("input_layernorm", _ATTN_QKV),
    SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "linear"),
    SmoothMapping("pre_feedforward_layernorm", _MLP_IN),
    SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "linear"),
)

_BLOCKS = r"^(model\.)?(language_model\.)?(model\.)?layers$"

ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": ArchMapping("llama", _BLOCKS, _SEQUENTIAL, _LLAMA_SMOOTH,
                         model_types=("llama", "mistral", "qwen2", "qwen3", "phi3_small_llama")),
    "gemma": ArchMapping("gemma", _BLOCKS, _SEQUENTIAL, _LLAMA_SMOOTH, norm_plus_one=True,
                         model_types=("gemma",)),
    "gemma2": ArchMapping("gemma2", _BLOCKS, _SEQUENTIAL, _GEMMA2_SMOOTH, norm_plus_one=True,
                          model_types=("gemma2", "gemma3", "gemma3_text")),
}


class UnknownArchitectureError(ValueError):
    """No mapping is declared for a model type."""


def mapping_for(model_type: str) -> ArchMapping:
    """The mapping for a config's `model_type` (e.g. "llama", "qwen2", "gemma3_text")."""
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types:
            return arch
    known = sorted(t for a in ARCHITECTURES.values() for t in a.model_types)
    raise UnknownArchitectureError(
        f"no layer mapping for model type {model_type!r}; known types: {', '.join(known)} "
        "(add an entry to fewbits.models.mappings.ARCHITECTURES)")


def find_blocks_path(module_names: list[str], arch: ArchMapping) -> str:
    """The full name of the decoder-block list among `module_names` (from `model.named_modules()`)."""
    pattern = re.compile(arch.blocks)
    hits = [n for n in module_names if pattern.match(n)]
    if not hits:
        raise UnknownArchitectureError(
            f"no module matches the decoder-block pattern {arch.blocks!r} of family {arch.family!r}")
    return min(hits, key=len)
