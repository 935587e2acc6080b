"""Checkpoints other tools wrote, loaded as dense Hugging Face models for evaluation against a reference.

    kind = checkpoint_kind(path)             # "gguf", "compressed-tensors", "gptq", "awq", "fewbits" or error
    model, info = load_external(path)         # the dequantised model (float32) and what the file stores

* GGUF (a .gguf file, or a directory holding one): transformers' GGUF loader, which dequantises every
  tensor with gguf-py (every type gguf-py reads, K-quants and i-quants included) and undoes llama.cpp's
  row permutations and Gemma's norm shift.
* compressed-tensors directories (llm-compressor, fewbits' own export): transformers with the
  compressed-tensors package, which decompresses the weights.
* GPTQ directories (AutoGPTQ / GPTQModel layout: `qweight` int32 words packed along the input, `qzeros`
  packed along the output and stored minus one in the original "gptq" checkpoint format, `scales`,
  `g_idx`) and AWQ "gemm" directories (`qweight` / `qzeros` packed along the output in AWQ's nibble order
  0 2 4 6 1 3 5 7, no offset): dequantised here, w = scale * (q - zero), into the model the config names.

`info` says what was stored: the checkpoint kind, a format description, bytes and bits per weight of the
quantised linear weights (scales and zeros included) as the files hold them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fewbits.formats.packing import unpack_int32


class CheckpointError(ValueError):
    """A path that is no checkpoint fewbits can read, or a checkpoint layout it does not know."""


#: AWQ's "gemm" packing: nibble k of a word holds output column AWQ_ORDER[k] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _gguf_file(p: Path) -> Path | None:
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None


def _quant_config(d: Path) -> dict[str, Any]:
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        return {}
    qc = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    if not qc and (d / "quantize_config.json").is_file():  # AutoGPTQ's older side file
        qc = {"quant_method": "gptq", **json.loads((d / "quantize_config.json").read_text())}
    return qc


def checkpoint_kind(path: str | os.PathLike[str]) -> str:
    """What `path` holds: "fewbits", "gguf", "compressed-tensors", "gptq" or "awq"; CheckpointError otherwise."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if (p / "fewbits.json").is_file():
        return "fewbits"
    if _gguf_file(p) is not None:
        return "gguf"
    method = str(_quant_config(p).get("quant_method", "")).lower() if p.is_dir() else ""
    if method in ("compressed-tensors", "gptq", "awq"):
        return method
    raise CheckpointError(f"{p}: not a checkpoint fewbits reads (a fewbits directory, a .gguf file, or a "
                          f"compressed-tensors / GPTQ / AWQ directory with its quantization_config)")


def load_external(path: str | os.PathLike[str]) -> tuple[nn.Module, dict[str, Any]]:
    """(dense float32 model in eval mode, info) for a GGUF file or a compressed-tensors / GPTQ / AWQ directory."""
    from fewbits.models.loading import refuse_remote_code

    kind = checkpoint_kind(path)
    p = Path(path)
    refuse_remote_code(p if p.is_dir() else p.parent)  # no Python from the folder is ever run
    if kind == "gguf":
        return _load_gguf(_gguf_file(p))  # type: ignore[arg-type]
    if kind == "compressed-tensors":
        return _load_compressed_tensors(p)
    if kind in ("gptq", "awq"):
        return _load_packed_int(p, kind)
    raise CheckpointError(f"{p}: a fewbits directory; load it with fewbits.api.load_quantized_model")


# ---------------------------------------------------------------------- GGUF
def _load_gguf(f: Path) -> tuple[nn.Module, dict[str, Any]]:
    from collections import Counter

    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    reader = GGUFReader(f)
    linear = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    types = Counter(t.tensor_type.name for t in linear)
    nbytes = sum(int(t.n_bytes) for t in linear)
    n = sum(int(t.n_elements) for t in linear)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    except (ValueError, KeyError, NotImplementedError) as e:  # an architecture or type transformers lacks
        raise CheckpointError(f"{f}: transformers cannot load this GGUF file ({e})") from e
    fmt = ", ".join(f"{k} x{v}" for k, v in types.most_common())
    info = {"kind": "gguf", "method": "gguf", "format": fmt or "dense", "linear_bytes": nbytes,
            "bits_per_weight": 8 * nbytes / n if n else None, "file_bytes": f.stat().st_size}
    return model.eval(), info


# ---------------------------------------------------------------------- compressed-tensors
def _load_compressed_tensors(d: Path) -> tuple[nn.Module, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    qc = _quant_config(d)
    tensors = _read_safetensors(d)
    packed = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale"))}
    n = sum(int(tensors[f"{p}.weight_shape"].prod()) if f"{p}.weight_shape" in tensors else
            tensors[f"{p}.weight"].numel() for p in packed)  # packed ints carry their shape; fp8 is the weight
    info = _packed_info(tensors, packed, d, "compressed-tensors", _ct_description(qc), n)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, trust_remote_code=False)
    return model.eval(), info


def _ct_description(qc: dict[str, Any]) -> str:
    parts = []
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        g = f"-g{w['group_size']}" if w.get("group_size") else ""
        parts.append(f"{w.get('type', 'int')}{w.get('num_bits', '?')}{g}{'' if w.get('symmetric', True) else '-asym'}")
    return "compressed-tensors " + ", ".join(parts)


# ---------------------------------------------------------------------- GPTQ / AWQ
def _read_safetensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no .safetensors weight files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _packed_info(tensors: dict[str, torch.Tensor], prefixes: set[str], d: Path, kind: str, fmt: str,
                 n_weights: int) -> dict[str, Any]:
    """Bytes the files hold for the quantised linear weights (codes, scales, zeros, group indices) per weight."""
    nbytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.rsplit(".", 1)[0] in prefixes
                 and not k.endswith(".bias"))
    return {"kind": kind, "method": kind, "format": fmt, "linear_bytes": nbytes,
            "bits_per_weight": 8 * nbytes / n_weights if n_weights else None,
            "file_bytes": sum(f.stat().st_size for f in d.glob("*.safetensors"))}


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, zero_offset: int = 1) -> torch.Tensor:
    """GPTQ's packed layer -> float32 weight (out, in).  qweight int32 (in * bits / 32, out), qzeros int32
    (groups, out * bits / 32), scales (groups, out), g_idx (in,) the group of each input (None: in order);
    zero_offset: 1 for the "gptq" checkpoint format, which stores each zero point minus one, 0 for "gptq_v2"."""
    out_f = scales.shape[1]
    in_f = g_idx.numel() if g_idx is not None else qweight.shape[0] * 32 // bits
    q = unpack_int32(qweight.T.contiguous(), bits, in_f)  # (out, in): each output's inputs are one bit stream
    z = unpack_int32(qzeros, bits, out_f).to(torch.int16) + zero_offset  # (groups, out)
    groups = scales.shape[0]
    g = g_idx.long() if g_idx is not None else torch.arange(in_f) // (in_f // groups)
    s = scales.float()
    return (q.to(torch.int16) - z[g].T).float() * s[g].T


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's "gemm" packed layer -> float32 weight (out, in): qweight int32 (in, out / 8), qzeros int32
    (groups, out / 8), both with nibble k holding column AWQ_ORDER[k] of its 8; scales (groups, out)."""
    def unpack(words: torch.Tensor) -> torch.Tensor:  # (r, out / 8) -> (r, out) 4-bit codes
        w = words.to(torch.int64) & 0xFFFFFFFF
        nib = (w.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF  # (r, out / 8, 8): nibble k
        cols = torch.empty_like(nib)
        cols[..., list(AWQ_ORDER)] = nib  # nibble k -> column AWQ_ORDER[k]
        return cols.reshape(words.shape[0], -1)

    q, z = unpack(qweight), unpack(qzeros)  # (in, out), (groups, out)
    g = torch.arange(q.shape[0]) // group_size
    return ((q - z[g]).float() * scales.float()[g]).T.contiguous()


def _load_packed_int(d: Path, kind: str) -> tuple[nn.Module, dict[str, Any]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    qc = _quant_config(d)
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    tensors = _read_safetensors(d)
    prefixes = {k[:-len(".qweight")] for k in tensors if k.endswith(".qweight")}
    if not prefixes:
        raise CheckpointError(f"{d}: a {kind} config but no .qweight tensors")
    state = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in prefixes or k.endswith(".bias")}
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    n = 0
    for p in sorted(prefixes):
        if kind == "gptq":
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise CheckpointError(f"{d}: GPTQ checkpoint format {fmt!r} is not read (gptq, gptq_v2)")
            w = dequantize_gptq(tensors[f"{p}.qweight"], tensors[f"{p}.qzeros"], tensors[f"{p}.scales"],
                                tensors.get(f"{p}.g_idx"), bits, 1 if fmt == "gptq" else 0)
        else:
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or bits != 4:
                raise CheckpointError(f"{d}: AWQ {version} {bits}-bit is not read (4-bit gemm)")
            w = dequantize_awq(tensors[f"{p}.qweight"], tensors[f"{p}.qzeros"], tensors[f"{p}.scales"], group)
        state[f"{p}.weight"] = w
        n += w.numel()
    config = AutoConfig.from_pretrained(d, trust_remote_code=False)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (getattr(config, "tie_word_embeddings", False) and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{d}: weights do not match {type(model).__name__}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    desc = f"{kind} int{bits}-g{group}" + ("" if qc.get("sym", True) else "-asym")
    return model.eval(), _packed_info(tensors, prefixes, d, kind, desc, n)
