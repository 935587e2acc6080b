"""GGUF files for llama.cpp, written from fewbits' quantised weights without quantising again.

    export_gguf(model, "smol.gguf", tokenizer)      # after fewbits.api.quantize (any mix of the formats below)

A fewbits format is written as the GGUF type that stores exactly the same numbers, or refused:

=====================  ===========  ==========================================================
fewbits                GGUF         why it is the same numbers
=====================  ===========  ==========================================================
q4_0 ... q6_k          Q4_0 ...     llama.cpp's block types (formats/ggml.py): the bytes as stored
int8-g32 / int5-g32    Q8_0 / Q5_0  fp16 scale d per 32, w = d * q, q = code - 2^(b-1)
int4-g32               Q4_0         the same, codes 1..15 (the -8 code unused with the -7..7 grid)
bf16 / fp16 / fp32     BF16 / F16   dense weights in 16 bits (fp32 as F16, BF16 beyond F16's range);
                                    norms and biases F32
=====================  ===========  ==========================================================

so a model quantised by any fewbits method (GPTQ, AWQ, HQQ codes included) keeps its codes and scales,
and a recipe that mixes formats layer by layer gives one file with one type per tensor.  Either symmetric
grid fits Q4_0 and Q8_0 (the full grid's q = -8 / -128 included, scales of either sign); fewbits' RTN
rounds as llama.cpp does, so RTN int4-g32 (the full grid) writes Q4_0's bytes and RTN int8-g32-narrow
Q8_0's (Q8_0's grid is the narrow +-127).  Asymmetric integer formats are refused: Q4_1 / Q5_1 decode
w = d * c + m with m an fp16 number, while fewbits' zero points give m = -z * s (integer z: up to 15
significant bits; fp16 z: up to 22), which fp16 does not hold in general, so the file would not hold
fewbits' numbers; `q4_1` / `q5_1` quantise on Q4_1's own grid.

Architectures are data (`ARCHS`): the tensor names and metadata keys of each; Llama and Mistral (written
as llama.cpp's "llama"), Qwen2 (q/k/v biases in F32), Gemma-3 (q/k norms and sandwich norms; norm weights
stored as 1 + w, as llama.cpp multiplies by the stored weight where Gemma's RMSNorm uses 1 + w).  For
Llama, llama.cpp stores the rows of q and k permuted for its rotary layout (each head's two halves
interleaved); the writer permutes the packed rows the same way (a row keeps its blocks).  The vocabulary
is built from a byte-level BPE tokenizer or copied from a GGUF file (`vocab_from`: a packaged model's own;
gguf_vocab.py).  Formats and architectures outside the tables are refused by name before anything is
written; the file is written beside `out_path` and renamed into place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fewbits.export.common import ExportError, quantised_layers
from fewbits.export.gguf_vocab import Field, bpe_fields, gguf_fields, write_fields
from fewbits.files import check_output, write_file
from fewbits.formats import ggml
from fewbits.formats.format import Format, parse_format
from fewbits.formats.ggml_types import GGML_TYPES
from fewbits.tensor import QuantizedTensor


@dataclass(frozen=True)
class GGUFArch:
    """How one architecture's tensors and hyperparameters are named in GGUF."""

    name: str  # general.architecture
    tensors: dict[str, str]  # HF parameter name (with {i} for the block) -> GGUF tensor name
    permute_qk: bool  # llama.cpp's rotary row order for q and k
    norm_shift: float = 0.0  # added to every norm weight (Gemma: llama.cpp multiplies by the weight as stored)
    head_dims: bool = False  # write attention.key_length / value_length (head_dim need not be hidden / heads)
    sliding_window: bool = False  # write attention.sliding_window from the config


_LLAMA_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
_QWEN2_TENSORS = {**_LLAMA_TENSORS, **{f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"blk.{{i}}.attn_{p}.bias"
                                        for p in "qkv"}}
_GEMMA3_TENSORS = {
    **{k: v for k, v in _LLAMA_TENSORS.items() if "post_attention_layernorm" not in k},
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
}
#: transformers model_type -> how it is written
ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", _LLAMA_TENSORS, permute_qk=True),
    "mistral": GGUFArch("llama", _LLAMA_TENSORS, permute_qk=True),  # llama.cpp reads Mistral as Llama
    "qwen2": GGUFArch("qwen2", _QWEN2_TENSORS, permute_qk=False),  # q/k/v biases; rotary rows as HF keeps them
    "gemma3_text": GGUFArch("gemma3", _GEMMA3_TENSORS, permute_qk=False, norm_shift=1.0, head_dims=True,
                            sliding_window=True),
}


def gguf_arch(model: nn.Module) -> GGUFArch:
    """How `model`'s architecture is written, or ExportError naming it."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    arch = ARCHS.get(getattr(cfg, "model_type", ""))
    if arch is None:
        raise ExportError(f"GGUF export knows the architectures {sorted(ARCHS)}; this model is "
                          f"{getattr(cfg, 'model_type', type(model).__name__)!r}")
    return arch


def gguf_type(fmt: Format) -> str:
    """The GGUF type that holds `fmt`'s numbers exactly ("Q4_K", "Q8_0", "F16", ...), or ExportError."""
    if not fmt.is_quantized:
        return {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[fmt.spec]
    if fmt.kind == "ggml":
        return GGML_TYPES[fmt.element].gguf_name
    exact = fmt.kind == "int" and fmt.symmetric and fmt.granularity == "group" and fmt.group_size == 32 \
        and fmt.scale_dtype == "fp16"
    if exact and fmt.bits in _SYMMETRIC_G32:
        return _SYMMETRIC_G32[fmt.bits].upper()
    why = ("Q4_1 / Q5_1 store the group minimum as an fp16 number, which fewbits' zero points (-z * s) do not "
           "give exactly; quantise with q4_1 / q5_1 instead" if fmt.kind == "int" and not fmt.symmetric else
           "they are symmetric with fp16 scales per 32")
    raise ExportError(f"{fmt.spec}: GGUF export writes llama.cpp's block types (q4_0 ... q6_k) and int4-g32 / "
                      f"int5-g32 / int8-g32 as Q4_0 / Q5_0 / Q8_0, whose numbers those types hold exactly: {why}")


#: symmetric integer g32 formats -> the block type with the same numbers (code offset 2^(b-1), fp16 d)
_SYMMETRIC_G32 = {4: "q4_0", 5: "q5_0", 8: "q8_0"}


def _blocks(qt: QuantizedTensor) -> np.ndarray:
    """(rows, bytes per row) uint8 in llama.cpp's block layout."""
    if qt.fmt.kind == "ggml":
        return ggml.to_gguf_blocks(qt.unpacked_codes(), qt.scales, qt.fmt).numpy()
    bt = parse_format(_SYMMETRIC_G32[qt.fmt.bits])  # same numbers: the scale is the block's fp16 d
    header = qt.scales.to(torch.float16).contiguous().view(torch.uint8)  # (rows, groups * 2)
    return ggml.to_gguf_blocks(qt.unpacked_codes(), header, bt).numpy()


def dense_type(value: torch.Tensor) -> str:
    """The GGUF type a dense tensor is written in: F32 for vectors (norms, biases), else 16 bits: BF16 and
    F16 as they are, fp32 as F16 (as llama.cpp's converter does), BF16 where a value exceeds F16's range."""
    if value.dim() == 1:
        return "F32"
    if value.dtype == torch.bfloat16:
        return "BF16"
    if value.dtype == torch.float16:
        return "F16"
    return "F16" if float(value.detach().abs().max()) <= 65504.0 else "BF16"


def _permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for q / k: per head, the two rotary halves interleaved."""
    return torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)


def _take_rows(qt: QuantizedTensor, idx: torch.Tensor) -> QuantizedTensor:
    from dataclasses import replace

    return replace(qt, codes=qt.codes[idx], scales=qt.scales[idx] if qt.scales is not None else None,
                   zeros=qt.zeros[idx] if qt.zeros is not None else None)


def export_gguf(model: nn.Module, out_path: str | os.PathLike[str], tokenizer: Any, pre: str | None = None,
                overwrite: bool = False, vocab_from: str | os.PathLike[str] | None = None,
                embedding: str | Format | None = None) -> Path:
    """Write `model` (after `fewbits.api.quantize`) and `tokenizer` as one GGUF file at `out_path`.

    vocab_from: a GGUF file whose tokenizer.* fields are copied instead of being built from `tokenizer`
    (needed for SentencePiece vocabularies such as Gemma's).
    embedding: a format for the token embedding (`token_embd`, which a tied model's head reads too),
    RTN-quantised here, as llama.cpp's own mixes store it (Q8_0 or Q6_K): e.g. "q8_0", "q6_k", "int8-g32".
    The file then differs from the fewbits model in that one tensor, which keeps its 16-bit rows;
    `fewbits eval` of the file measures it.  None: 16 bits, as the model holds it."""
    import gguf

    from fewbits.tensor import quantize_tensor

    out = check_output(out_path, overwrite, "file")  # before the work; write_file checks again
    emb_fmt = None if embedding is None else parse_format(embedding)
    if emb_fmt is not None:
        gguf_type(emb_fmt)  # a type GGUF holds, or ExportError before any work
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    arch = gguf_arch(model)
    layers = quantised_layers(model, "GGUF", require=False)  # a 16-bit model is written as it is
    n_head, n_kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    # every tensor: (GGUF name, QuantizedTensor or dense tensor), refusing before anything is written
    items: list[tuple[str, QuantizedTensor | torch.Tensor, str]] = []
    state = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in layers}
    for name, mod in layers.items():
        state[f"{name}.weight"] = mod.qweight
        if mod.bias is not None:  # written in F32 where the architecture names it, else refused by name
            state[f"{name}.bias"] = mod.bias.detach()
    tied = getattr(cfg, "tie_word_embeddings", False) and "lm_head" not in layers
    for key, value in state.items():
        if tied and key == "lm_head.weight":
            continue  # llama.cpp reads a missing output.weight from token_embd
        if not isinstance(value, QuantizedTensor) and not value.is_floating_point():
            continue  # integer buffers are no weights
        gname = _gguf_name(arch, key)
        if emb_fmt is not None and gname == "token_embd.weight":
            value = quantize_tensor(value.detach().float(), emb_fmt, name=key)
        if isinstance(value, QuantizedTensor):
            kind = gguf_type(value.fmt)
            if arch.permute_qk and (".attn_q." in gname or ".attn_k." in gname):
                value = _take_rows(value, _permute_rows(value.shape[0], n_head if ".attn_q." in gname else n_kv))
        else:
            kind = dense_type(value)
            if arch.norm_shift and gname.endswith("norm.weight"):
                value = value.float() + arch.norm_shift
            if arch.permute_qk and (".attn_q." in gname or ".attn_k." in gname):
                value = value[_permute_rows(value.shape[0], n_head if ".attn_q." in gname else n_kv)]
        items.append((gname, value, kind))
    tok_fields: list[Field] = gguf_fields(vocab_from) if vocab_from is not None else \
        bpe_fields(tokenizer, int(cfg.vocab_size), pre)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, arch.name)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head)
        w.add_name(Path(str(getattr(cfg, "_name_or_path", "") or arch.name)).name)
        w.add_context_length(int(cfg.max_position_embeddings))
        w.add_embedding_length(int(cfg.hidden_size))
        w.add_block_count(int(cfg.num_hidden_layers))
        w.add_feed_forward_length(int(cfg.intermediate_size))
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv)
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_rope_freq_base(float(_rope_theta(cfg)))
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(int(cfg.vocab_size))
        if arch.head_dims:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch.sliding_window and getattr(cfg, "sliding_window", None):
            w.add_sliding_window(int(cfg.sliding_window))
        write_fields(w, tok_fields)
        for gname, value, kind in items:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            if isinstance(value, QuantizedTensor):
                w.add_tensor(gname, _blocks(value), raw_dtype=qtype)  # shape: (rows, bytes)
            else:
                arr = value.detach().to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind])
                data = arr.view(torch.int16).numpy() if kind == "BF16" else arr.numpy()
                w.add_tensor(gname, data, raw_shape=list(arr.shape), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return write_file(out, write, overwrite)


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters, per layer type where they differ
        params = getattr(cfg, "rope_parameters", None) or {}
        params = params.get("full_attention", params)  # Gemma-3: the global layers' base (local: 10000)
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def _gguf_name(arch: GGUFArch, key: str) -> str:
    parts = key.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            pattern = ".".join(parts[:i] + ["{i}"] + parts[i + 1:])
            if pattern in arch.tensors:
                return arch.tensors[pattern].format(i=p)
    if key in arch.tensors:
        return arch.tensors[key]
    raise ExportError(f"{key}: no {arch.name} GGUF tensor name for it")
