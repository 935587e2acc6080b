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
from dataclasses import dataclass, field, replace


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
    experts: mixture-of-experts families: the path inside a block of the fused experts module (one linear
        per expert once `fewbits.models.moe.unfuse_experts` has split it), and `num_experts_key` the config
        field that counts them.  Paths holding EXPERT ("{e}") are templates, written out per expert by
        `with_experts`; `input_sets` (filled there) lists the linears of one expert that see one input.
    """

    family: str
    blocks: str
    sequential: tuple[tuple[str, ...], ...]
    smooth: tuple[SmoothMapping, ...]
    norm_plus_one: bool = False
    model_types: tuple[str, ...] = field(default_factory=tuple)
    outputs: tuple[tuple[str, str], ...] = (("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj"))
    experts: str = ""
    num_experts_key: str = ""
    input_sets: tuple[tuple[str, ...], ...] = ()

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(p for group in self.sequential for p in group)

    def with_experts(self, n: int) -> ArchMapping:
        """This mapping for a model of `n` experts per MoE block: a sequential group of expert templates
        becomes one group holding every expert's linears (the experts' inputs are independent, so one pass
        over the block collects all of them), in which each expert's own linears share an input (its routed
        tokens: `input_sets`); a smoothing mapping of templates becomes one mapping per expert."""
        def per_expert(paths: tuple[str, ...]) -> list[tuple[str, ...]]:
            if not any(EXPERT in p for p in paths):
                return [paths]
            return [tuple(p.replace(EXPERT, str(e)) for p in paths) for e in range(n)]

        sequential = tuple(tuple(p for s in per_expert(g) for p in s) for g in self.sequential)
        sets = tuple(s for g in self.sequential if any(EXPERT in p for p in g) for s in per_expert(g))
        smooth = tuple(SmoothMapping(m.prev.replace(EXPERT, str(e)), lin, m.prev_kind)
                       for m in self.smooth for e, lin in enumerate(per_expert(m.linears)))
        return replace(self, sequential=sequential, smooth=smooth, input_sets=sets)

    def same_input(self, group: tuple[str, ...]) -> list[tuple[str, ...]]:
        """`group` (a declared sequential group) split into the linears that see one input: the whole group,
        or for a group of experts, each expert's linears."""
        sets = [tuple(p for p in s if p in group) for s in self.input_sets]
        sets = [s for s in sets if s]
        inside = {p for s in sets for p in s}
        rest = tuple(p for p in group if p not in inside)
        return sets + ([rest] if rest else [])

    def is_expert(self, path: str) -> bool:
        """Whether `path` (inside a block, after `with_experts`) is a routed expert's linear."""
        return any(path in s for s in self.input_sets)


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

#: the expert index in a template path of a mixture-of-experts mapping
EXPERT = "{e}"

# Mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE as transformers 5 builds them): the router
# (`mlp.gate`, not a linear layer) and a shared expert's gate (`mlp.shared_expert_gate`, one output row)
# read the same input as the experts; each expert is a gated MLP seeing only the tokens routed to it.
# The norm before the block feeds the router and every expert, so no AWQ scale is folded into it; each
# expert's up_proj -> down_proj is its own fold.  Dense layers of Qwen2-MoE (`mlp_only_layers`) keep
# the plain MLP paths.
_EXPERT_IN = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj")
_SHARED_IN = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
_MOE_SEQUENTIAL = (_ATTN_QKV, ("self_attn.o_proj",), _MLP_IN, ("mlp.down_proj",), _SHARED_IN,
                   ("mlp.shared_expert.down_proj",), _EXPERT_IN, ("mlp.experts.{e}.down_proj",))
_MOE_SMOOTH = (
    *_LLAMA_SMOOTH,
    SmoothMapping("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), "linear"),
    SmoothMapping("mlp.experts.{e}.up_proj", ("mlp.experts.{e}.down_proj",), "linear"),
)

_BLOCKS = r"^(model\.)?(language_model\.)?(model\.)?layers$"

ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": ArchMapping("llama", _BLOCKS, _SEQUENTIAL, _LLAMA_SMOOTH,
                         model_types=("llama", "mistral", "qwen2", "qwen3", "phi3_small_llama")),
    "gemma": ArchMapping("gemma", _BLOCKS, _SEQUENTIAL, _LLAMA_SMOOTH, norm_plus_one=True,
                         model_types=("gemma",)),
    "gemma2": ArchMapping("gemma2", _BLOCKS, _SEQUENTIAL, _GEMMA2_SMOOTH, norm_plus_one=True,
                          model_types=("gemma2", "gemma3", "gemma3_text")),
    "mixtral": ArchMapping("mixtral", _BLOCKS, _MOE_SEQUENTIAL, _MOE_SMOOTH, model_types=("mixtral",),
                           experts="mlp.experts", num_experts_key="num_local_experts"),
    "qwen_moe": ArchMapping("qwen_moe", _BLOCKS, _MOE_SEQUENTIAL, _MOE_SMOOTH, model_types=("qwen2_moe", "qwen3_moe"),
                            experts="mlp.experts", num_experts_key="num_experts"),
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


def mapping_for_config(config: object) -> ArchMapping:
    """The mapping for a transformers config (its text config for a multimodal wrapper), with the expert
    paths written out for the config's number of experts."""
    text = getattr(config, "text_config", None)
    cfg = text if getattr(text, "model_type", None) else config
    arch = mapping_for(getattr(cfg, "model_type", ""))
    if not arch.experts:
        return arch
    n = getattr(cfg, arch.num_experts_key, None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UnknownArchitectureError(f"{arch.family}: config field {arch.num_experts_key!r} is {n!r}, "
                                       "not a number of experts")
    return arch.with_experts(n)


def find_blocks_path(module_names: list[str], arch: ArchMapping) -> str:
    """The full name of the decoder-block list among `module_names` (from `model.named_modules()`)."""
    pattern = re.compile(arch.blocks)
    hits = [n for n in module_names if pattern.match(n)]
    if not hits:
        raise UnknownArchitectureError(
            f"no module matches the decoder-block pattern {arch.blocks!r} of family {arch.family!r}")
    return min(hits, key=len)
