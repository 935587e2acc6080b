"""GGUF files for llama.cpp, written from fewbits' quantised weights without quantising again.

    export_gguf(model, "smol.gguf", tokenizer)      # after fewbits.api.quantize with int4-g32 / int8-g32

A fewbits format is written as the GGUF type that stores exactly the same numbers, or refused:

=================  ==========  ==============================================================
fewbits            GGUF        block (32 weights)
=================  ==========  ==============================================================
int8-g32           Q8_0        fp16 scale d, 32 int8 q:            w = d * q
int4-g32           Q4_0        fp16 scale d, 16 bytes, q[j] low and q[j+16] high nibble:  w = d * (q - 8)
bf16 / fp16 / fp32  BF16 / F16 / F32   the tensor as it is (norms always F32)
=================  ==========  ==============================================================

so a model quantised by any fewbits method (GPTQ, AWQ, HQQ codes included) keeps its codes and scales.
Either symmetric grid fits both types (the full grid's q = -8 / -128 included, scales of either sign);
fewbits' RTN rounds as llama.cpp does, so RTN int4-g32 (the full grid) writes Q4_0's bytes and RTN
int8-g32-narrow Q8_0's (Q8_0's grid is the narrow +-127).
Architectures are data (`ARCHS`): the tensor names and metadata keys of each; Llama and Qwen2 (its q/k/v
biases in F32) so far.  For Llama, llama.cpp stores the rows of q and k permuted for its rotary layout
(each head's two halves interleaved); the writer permutes the packed rows the same way (a row keeps its
blocks).  The tokenizer
goes into the file as llama.cpp's "gpt2" BPE vocabulary (tokens, token types, merges, special ids) from a
Hugging Face fast tokenizer; its pre-tokenizer name (`tokenizer.ggml.pre`) is taken from `pre` (the
packaged SmolLM2 file says "smollm"), else "default".  Formats and architectures outside the table are
refused by name before anything is written; the file is written beside `out_path` and renamed into place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fewbits.export.common import ExportError, quantised_layers
from fewbits.export.files import write_file
from fewbits.formats.format import Format, parse_format
from fewbits.tensor import QuantizedTensor


@dataclass(frozen=True)
class GGUFArch:
    """How one architecture's tensors and hyperparameters are named in GGUF."""

    name: str  # general.architecture
    tensors: dict[str, str]  # HF parameter name (with {i} for the block) -> GGUF tensor name
    permute_qk: bool  # llama.cpp's rotary row order for q and k


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
#: transformers model_type -> how it is written
ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", _LLAMA_TENSORS, permute_qk=True),
    "qwen2": GGUFArch("qwen2", _QWEN2_TENSORS, permute_qk=False),  # q/k/v biases; rotary rows as HF keeps them
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
    """The GGUF type that holds `fmt`'s numbers exactly ("Q8_0", "Q4_0", "F32", ...), or ExportError."""
    if not fmt.is_quantized:
        return {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[fmt.spec]
    exact = fmt.kind == "int" and fmt.symmetric and fmt.granularity == "group" and fmt.group_size == 32 \
        and fmt.scale_dtype == "fp16"
    if exact and fmt.bits == 8:
        return "Q8_0"
    if exact and fmt.bits == 4:
        return "Q4_0"
    raise ExportError(f"{fmt.spec}: GGUF export writes int8-g32 (Q8_0) and int4-g32 (Q4_0), symmetric with "
                      f"fp16 scales, whose numbers those types hold exactly")


def _blocks(qt: QuantizedTensor, kind: str) -> np.ndarray:
    """(rows, bytes per row) uint8 in llama.cpp's block layout for Q8_0 / Q4_0."""
    rows, cols = qt.shape
    nb = cols // 32
    c = qt.unpacked_codes().reshape(rows, nb, 32).to(torch.int16)
    d = qt.scales.to(torch.float16).reshape(rows, nb, 1).contiguous().view(torch.uint8)  # (rows, nb, 2)
    if kind == "Q8_0":
        q = (c - 128).to(torch.int8).view(torch.uint8)  # codes carry offset 128: q = c - 128
    else:  # Q4_0: byte j holds element j (low nibble) and element j + 16 (high nibble)
        q = (c[..., :16] | (c[..., 16:] << 4)).to(torch.uint8)
    return torch.cat([d, q], -1).reshape(rows, -1).numpy()


def _permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for q / k: per head, the two rotary halves interleaved."""
    return torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)


def _take_rows(qt: QuantizedTensor, idx: torch.Tensor) -> QuantizedTensor:
    from dataclasses import replace

    return replace(qt, codes=qt.codes[idx], scales=qt.scales[idx] if qt.scales is not None else None,
                   zeros=qt.zeros[idx] if qt.zeros is not None else None)


def _tokenizer_fields(tokenizer: Any, vocab_size: int, pre: str | None) -> list[tuple[str, Any, str]]:
    """(key, value, kind) of llama.cpp's "gpt2" BPE vocabulary from a Hugging Face fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = json.loads(backend.to_str()) if backend is not None else {}
    if state.get("model", {}).get("type") != "BPE":
        raise ExportError("GGUF export writes BPE tokenizers (llama.cpp's gpt2 model); this tokenizer is "
                          f"{state.get('model', {}).get('type', type(tokenizer).__name__)}")
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    added = set(getattr(tokenizer, "added_tokens_encoder", {}))
    tokens, types = [], []
    for i in range(vocab_size):
        t = vocab.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # unused
        else:
            tokens.append(t)
            types.append(3 if t in special else 4 if t in added else 1)  # control, user-defined, normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"].get("merges", [])]
    fields: list[tuple[str, Any, str]] = [
        ("tokenizer.ggml.model", "gpt2", "str"), ("tokenizer.ggml.pre", pre or "default", "str"),
        ("tokenizer.ggml.tokens", tokens, "strs"), ("tokenizer.ggml.token_type", types, "ints"),
        ("tokenizer.ggml.merges", merges, "strs")]
    for key, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                     ("unknown", tokenizer.unk_token_id), ("padding", tokenizer.pad_token_id)):
        if tid is not None:
            fields.append((f"tokenizer.ggml.{key}_token_id", int(tid), "u32"))
    fields.append(("tokenizer.ggml.add_bos_token", bool(getattr(tokenizer, "add_bos_token", False)), "bool"))
    if getattr(tokenizer, "chat_template", None):
        fields.append(("tokenizer.chat_template", tokenizer.chat_template, "str"))
    return fields


def export_gguf(model: nn.Module, out_path: str | os.PathLike[str], tokenizer: Any, pre: str | None = None,
                overwrite: bool = False) -> Path:
    """Write `model` (after `fewbits.api.quantize`) and `tokenizer` as one GGUF file at `out_path`."""
    import gguf

    out = Path(out_path)
    if out.exists() and not overwrite:  # before the work; write_file checks again
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
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
        gname = _gguf_name(arch, key)
        if isinstance(value, QuantizedTensor):
            kind = gguf_type(value.fmt)
            if arch.permute_qk and (".attn_q." in gname or ".attn_k." in gname):
                value = _take_rows(value, _permute_rows(value.shape[0], n_head if ".attn_q." in gname else n_kv))
        else:
            kind = "F32" if value.dim() == 1 else gguf_type(parse_format(_dense_spec(value.dtype)))
            if arch.permute_qk and (".attn_q." in gname or ".attn_k." in gname):
                value = value[_permute_rows(value.shape[0], n_head if ".attn_q." in gname else n_kv)]
        items.append((gname, value, kind))
    tok_fields = _tokenizer_fields(tokenizer, int(cfg.vocab_size), pre)

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
        for key, value, kind in tok_fields:
            if kind == "str":
                w.add_string(key, value)
            elif kind in ("strs", "ints"):
                w.add_array(key, value)
            elif kind == "bool":
                w.add_bool(key, value)
            else:
                w.add_uint32(key, value)
        for gname, value, kind in items:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            if isinstance(value, QuantizedTensor):
                w.add_tensor(gname, _blocks(value, kind), raw_dtype=qtype)  # shape: (rows, bytes)
            else:
                arr = value.detach().float() if kind == "F32" else value.detach()
                data = arr.view(torch.int16).numpy() if kind == "BF16" else arr.numpy()
                w.add_tensor(gname, data, raw_shape=list(arr.shape), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return write_file(out, write, overwrite)


def _dense_spec(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
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
