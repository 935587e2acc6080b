"""Checkpoints in the compressed-tensors layout, which vLLM (and transformers) load.

    export_compressed_tensors(model, "out/", tokenizer)     # after fewbits.api.quantize

What is written: config.json with a ``quantization_config`` (quant_method "compressed-tensors", one config
group per weight format, naming its layers), tokenizer files, and model.safetensors.  A quantised linear
``L`` becomes

* integer formats ("pack-quantized", 1..8 bits): ``L.weight_packed`` int32 (rows, ceil(cols * bits / 32)),
  each row a little-endian bit stream of unsigned codes (code = signed value + 2^(bits-1)), element i at
  bit i * bits: exactly fewbits' own per-row packing, read as 32-bit words;
  ``L.weight_scale`` (rows, groups) or (rows, 1), in the dtype fewbits stores; ``L.weight_shape`` int64
  [rows, cols]; asymmetric formats add ``L.weight_zero_point``, the unsigned zero points packed the same
  way along the rows (int32 (ceil(rows * bits / 32), groups)).  Dequantised: (code - zero) * scale, as
  fewbits does.
* fp8-e4m3 ("float-quantized"): ``L.weight`` float8_e4m3fn and ``L.weight_scale`` float32.

Scales are written in the dtype fewbits stores them in (fp16 unless the format says otherwise), so a reader
that computes with them as written (the compressed-tensors package, transformers) gets fewbits' weights
exactly; an engine that casts them to the model's dtype (bf16, say) rounds each scale once more.
Checked here against the compressed-tensors package and transformers; not against vLLM itself (no GPU).

Everything else (embeddings, norms, a 16-bit LM head, biases) is written as it is.  Formats the layout
cannot express (float zero points, NF4, FP4, MX blocks, E5M2, a per-tensor integer scale with groups)
and layers that are not plain QuantLinears (outlier splits, activation quantisation) are refused
before anything is written, by name.  The directory is written beside `out_dir` and renamed into place.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fewbits.export.common import ExportError, quantised_layers
from fewbits.files import check_output, write_dir
from fewbits.formats.format import Format
from fewbits.formats.packing import pack_bits
from fewbits.models.qlinear import QuantLinear
from fewbits.tensor import QuantizedTensor
from fewbits.tensorfile import owned

#: the compressed-tensors version whose layout this writes (the format field of its config groups)
CT_VERSION = "0.20.1"
WEIGHTS_FILE = "model.safetensors"


def _scheme(fmt: Format) -> tuple[str, dict[str, Any]]:
    """(compressed-tensors format, weight quantisation args) for a fewbits format, or ExportError."""
    strategy = {"tensor": "tensor", "channel": "channel", "group": "group"}.get(fmt.granularity)
    if fmt.kind == "int":
        if fmt.float_zeros:
            raise ExportError(f"{fmt.spec}: compressed-tensors stores integer zero points, this format has "
                              f"{fmt.zero_dtype} ones")
        if strategy is None or not 1 <= fmt.bits <= 8:
            raise ExportError(f"{fmt.spec}: not an integer layout compressed-tensors has")
        args = {"num_bits": fmt.bits, "type": "int", "symmetric": bool(fmt.symmetric), "strategy": strategy,
                "group_size": fmt.group_size if strategy == "group" else None, "dynamic": False}
        return "pack-quantized", args
    if fmt.kind == "fp8" and fmt.element == "e4m3" and strategy in ("tensor", "channel"):
        return "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                                   "group_size": None, "dynamic": False}
    raise ExportError(f"{fmt.spec}: compressed-tensors export takes integer formats (1-8 bits, integer zero "
                      f"points) and per-channel or per-tensor fp8-e4m3")


def check_formats(specs: list[str]) -> None:
    """ExportError naming the first of `specs` (format specs, 16-bit ones allowed) that the layout cannot
    hold: for refusing a run before any quantisation work."""
    from fewbits.formats.format import parse_format

    for spec in specs:
        fmt = parse_format(spec)
        if fmt.is_quantized:
            _scheme(fmt)


def _words(bytes_per_row: torch.Tensor) -> torch.Tensor:
    """(rows, nbytes) uint8, a little-endian bit stream per row -> (rows, ceil(nbytes / 4)) int32 words
    (the first byte the lowest: on a big-endian host the bytes of each word are swapped first)."""
    pad = (-bytes_per_row.shape[1]) % 4
    b = torch.nn.functional.pad(bytes_per_row, (0, pad)).contiguous()
    if sys.byteorder != "little":
        b = b.reshape(b.shape[0], -1, 4).flip(-1).reshape(b.shape).contiguous()
    return b.reshape(-1).view(torch.int32).reshape(b.shape[0], -1)


def _layer_tensors(name: str, qt: QuantizedTensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors of one quantised linear `name` in the compressed-tensors layout."""
    fmt = qt.fmt
    rows, cols = qt.shape
    out: dict[str, torch.Tensor] = {}
    scale = qt.scale_values() if qt.tensor_scale is not None else qt.scales
    if fmt.kind == "int":
        out[f"{name}.weight_packed"] = _words(qt.codes.reshape(rows, -1))
        out[f"{name}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        out[f"{name}.weight_scale"] = scale.reshape(1) if fmt.granularity == "tensor" else scale.reshape(rows, -1)
        z = qt.zero_values()
        if z is not None:
            if fmt.granularity == "tensor":
                raise ExportError(f"{name}: {fmt.spec}: compressed-tensors keeps no zero point per tensor")
            zt = z.to(torch.uint8).t().contiguous()  # (groups, rows): packed along the rows
            out[f"{name}.weight_zero_point"] = _words(pack_bits(zt, fmt.bits)).t().contiguous()
    else:  # fp8-e4m3
        out[f"{name}.weight"] = qt.codes.reshape(rows, cols).view(torch.float8_e4m3fn)
        s = scale.float()
        out[f"{name}.weight_scale"] = s.reshape(1) if fmt.granularity == "tensor" else s.reshape(rows, 1)
    if bias is not None:
        out[f"{name}.bias"] = bias.detach()
    return out


def export_compressed_tensors(model: nn.Module, out_dir: str | os.PathLike[str], tokenizer: Any = None,
                              overwrite: bool = False, extra: Mapping[str, str | bytes] | None = None) -> Path:
    """Write `model` (after `fewbits.api.quantize`) as a compressed-tensors checkpoint in `out_dir`
    (`extra`: more files, name -> contents, inside the same atomic write)."""
    from safetensors.torch import save_file

    check_output(out_dir, overwrite)  # before the tensors are converted
    layers = quantised_layers(model, "compressed-tensors")
    schemes = {name: _scheme(m.fmt) for name, m in layers.items()}  # refuses before writing
    tensors: dict[str, torch.Tensor] = {}
    for name, m in layers.items():
        tensors.update(_layer_tensors(name, m.qweight, m.bias))
    seen: set[tuple[int, int]] = set()
    for key, t in model.state_dict().items():
        owner = key.rsplit(".", 1)[0]
        if owner in layers:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen:  # a tied weight: written once, the config ties it again
            continue
        seen.add(ident)
        tensors[key] = t.detach()
    groups: dict[tuple[str, str], list[str]] = {}
    for name, (ct_format, args) in schemes.items():
        groups.setdefault((ct_format, json.dumps(args, sort_keys=True)), []).append(name)
    if len(groups) == 1:  # one format for every quantised layer: target the class, ignore the rest
        groups = {key: ["Linear"] for key in groups}
    config_groups = {
        f"group_{i}": {"targets": names, "weights": json.loads(args), "input_activations": None,
                       "output_activations": None, "format": ct_format}
        for i, ((ct_format, args), names) in enumerate(groups.items())}
    formats = {f for f, _ in groups}
    quant_config = {
        "quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed", "config_groups": config_groups,
        "ignore": sorted(n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)),
        "kv_cache_scheme": None, "version": CT_VERSION}
    config = model.config
    config_dict = config.to_dict()
    config_dict["quantization_config"] = quant_config
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, QuantLinear):  # a quantised head no longer shares the embedding's weight
        config_dict["tie_word_embeddings"] = False
        if hasattr(config, "get_text_config") and "text_config" in config_dict:
            config_dict["text_config"]["tie_word_embeddings"] = False

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, default=str))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file({k: owned(v) for k, v in tensors.items()}, tmp / WEIGHTS_FILE, metadata={"format": "pt"})

    return write_dir(Path(out_dir), write, overwrite, kind="compressed-tensors", extra=extra)
