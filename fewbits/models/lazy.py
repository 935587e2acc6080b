"""A Hugging Face safetensors checkpoint opened without its weights: a skeleton model whose parameters live
on the meta device, and the tensors read from disk one module at a time.

    lazy = LazyModel.open("/models/llama-3-8b", dtype="bf16")    # config + shard headers; no weights read
    block = lazy.load("model.layers.3")     # a copy of the block with its weights read from the shards
    ...                                     # quantise it, write it out
    lazy.free("model.layers.3")             # the meta block goes back in its place; the copy is dropped

Why these choices:
- The skeleton is built by transformers from the config under accelerate's `init_empty_weights` with
  buffers kept real: parameters cost nothing, while the buffers the model computes itself and never
  stores (rotary `inv_freq`) are the real values `from_pretrained` would have.
- A loaded module is a deep copy of the meta module with real tensors; `free` puts the untouched meta
  module back.  Whatever the caller did to the copy (layers swapped for QuantLinear, kernels holding
  references) goes away with it, so nothing of a finished block stays in memory.
- Tensors are read with plain reads at the offsets of the safetensors header, not through a memory
  map: the pages of a mapped shard count in the process's resident memory for as long as it is mapped,
  and a big tensor can be read a few rows at a time (`rows`), never whole.
- Parameters take the dtype of the skeleton (the `dtype` asked for, as `from_pretrained(dtype=...)`
  does); a checkpoint tensor missing or of another shape is an error naming it, before any work.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fewbits.models.loading import (
    ModelLoadError,
    _auto_class,
    _torch_dtype,
    check_model_dir,
    read_safetensors_header,
    refuse_remote_code,
)

#: safetensors dtype names -> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: a tensor copied through without being loaded is read in pieces of about this many bytes
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lies: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index of the first dimension; the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class CheckpointIndex:
    """Every tensor of a safetensors checkpoint (one file or shards named by an index json), from the
    headers alone; `read` and `rows` read tensors from disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, TensorEntry] = {}
        files = check_model_dir(self.path)  # every shard present, every header readable and complete
        index = sorted(self.path.glob("*.safetensors.index.json"))
        weight_map = json.loads(index[0].read_text())["weight_map"] if index else None  # read by check_model_dir
        for f in files:
            header = read_safetensors_header(f)
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            for name, v in header.items():
                if name == "__metadata__" or (weight_map is not None and weight_map.get(name) != f.name):
                    continue  # the index says where each tensor is, as transformers reads it
                if v["dtype"] not in ST_DTYPES:
                    raise ModelLoadError(f"weight file {f}: tensor {name} has dtype {v['dtype']}, which fewbits "
                                         "cannot read")
                a, b = v["data_offsets"]
                self.entries[name] = TensorEntry(f, ST_DTYPES[v["dtype"]], tuple(v["shape"]), 8 + n + a, b - a)
        lost = sorted(set(weight_map or ()) - set(self.entries))
        if lost:
            raise ModelLoadError(f"weight index {index[0]} names {len(lost)} tensor(s) their shard does not hold: "
                                 f"{', '.join(lost[:4])}")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str, row0: int = 0, row1: int | None = None) -> torch.Tensor:
        """Tensor `name` (rows row0:row1 of its first dimension), in its stored dtype, read from disk."""
        e = self.entries[name]
        if not e.shape:
            row0, row1, shape = 0, 1, ()
        else:
            row1 = e.shape[0] if row1 is None else row1
            shape = (row1 - row0, *e.shape[1:])
        size = (row1 - row0) * e.row_bytes
        buf = torch.empty(size, dtype=torch.uint8)
        with e.file.open("rb", buffering=0) as fh:
            fh.seek(e.start + row0 * e.row_bytes)
            view, got = memoryview(buf.numpy()), 0
            while got < size:
                n = fh.readinto(view[got:])
                if not n:
                    raise ModelLoadError(f"weight file {e.file}: tensor {name} ends early (truncated file)")
                got += n
        return buf.view(e.dtype).reshape(shape)

    def rows(self, name: str, max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Tensor `name` in consecutive pieces of whole rows, each about `max_bytes` (at least one row)."""
        e = self.entries[name]
        if not e.shape or not e.shape[0]:
            yield self.read(name)
            return
        step = max(1, max_bytes // max(e.row_bytes, 1))
        for r in range(0, e.shape[0], step):
            yield self.read(name, r, min(r + step, e.shape[0]))


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    if is_param:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


class LazyModel:
    """A transformers model built from a checkpoint's config with no weights in memory (`model`, on the
    meta device), and the checkpoint's tensors (`index`) to fill any of its modules on demand."""

    def __init__(self, model: nn.Module, index: CheckpointIndex, path: Path) -> None:
        self.model, self.index, self.path = model, index, path
        self._pristine: dict[str, nn.Module] = {}  # module name -> its meta module while a copy is loaded
        self.source = self._source_names()

    @classmethod
    def open(cls, path: str | Path, dtype: Any = "float32") -> LazyModel:
        """Read config.json and the shard headers of directory `path`; build the skeleton in `dtype`."""
        import transformers
        from accelerate import init_empty_weights

        path = Path(path)
        index = CheckpointIndex(path)  # checks the folder (config.json, shards, headers) first
        refuse_remote_code(path)
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model directory {path}: config.json cannot be read: {exc}") from None
        auto = _auto_class(getattr(config, "architectures", None))
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(config, dtype=_torch_dtype(dtype))
        model.tie_weights()  # init_empty_weights registers a fresh meta parameter on every assignment: tie again
        return cls(model.eval(), index, path)

    def _source_names(self) -> dict[str, str]:
        """Skeleton tensor name -> checkpoint tensor name, every parameter checked (tied twins read from
        whichever name the checkpoint stores); buffers are read where the checkpoint has them."""
        groups: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        out: dict[str, str] = {}
        for names in groups.values():
            found = next((n for n in names if n in self.index), None)
            if found is None:
                raise ModelLoadError(f"checkpoint {self.path} has no tensor {names[0]} (the model "
                                     f"{type(self.model).__name__} needs it); fewbits streams checkpoints whose "
                                     "tensor names are the model's own")
            for n in names:
                out[n] = found
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for n, src in out.items():
            want, got = tuple(params[n].shape), self.index.entries[src].shape
            if want != got:
                raise ModelLoadError(f"checkpoint {self.path}: tensor {src} has shape {got}, the model's {n} "
                                     f"needs {want}")
        for n, _ in self.model.named_buffers(remove_duplicate=False):
            if n in self.index:
                out[n] = n
        return out

    def is_loaded(self, name: str) -> bool:
        return name in self._pristine

    def load(self, name: str) -> nn.Module:
        """Put a copy of module `name` with its weights read from disk in the model, and return it."""
        from fewbits.models.swap import replace_module

        if not name:
            raise ValueError("LazyModel.load reads one module of the model, not the whole model")
        if name in self._pristine:
            return self.model.get_submodule(name)
        meta = self.model.get_submodule(name)
        live = copy.deepcopy(meta)
        pre = f"{name}."
        for kind, items in (("param", live.named_parameters(remove_duplicate=False)),
                            ("buffer", live.named_buffers(remove_duplicate=False))):
            for n, t in list(items):
                src = self.source.get(pre + n)
                if src is None:
                    continue  # a buffer the model computes itself: already real
                value = self.index.read(src)
                if value.is_floating_point() and t.is_floating_point():
                    value = value.to(t.dtype)
                _set_tensor(live, n, value, kind == "param")
        replace_module(self.model, name, live)
        self._pristine[name] = meta
        return live

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (sorted, unique) of parameter `name` in the skeleton's dtype, gathered from pieces of
        CHUNK_BYTES (an embedding's rows for the calibration tokens, without the whole table in memory)."""
        want = self.model.get_parameter(name)
        src = self.source[name]
        parts, r0 = [], 0
        for piece in self.index.rows(src):
            r1 = r0 + piece.shape[0]
            sel = rows[(rows >= r0) & (rows < r1)] - r0
            if sel.numel():
                parts.append(piece[sel].to(want.dtype) if want.is_floating_point() else piece[sel])
            r0 = r1
        return torch.cat(parts) if parts else torch.empty((0, *want.shape[1:]), dtype=want.dtype)

    def free(self, name: str) -> None:
        """Put the meta module back at `name`, dropping the loaded copy (and whatever replaced its layers)."""
        from fewbits.models.swap import replace_module

        meta = self._pristine.pop(name, None)
        if meta is not None:
            replace_module(self.model, name, meta)

    def loaded_modules(self) -> list[str]:
        return list(self._pristine)


def state_names(model: nn.Module) -> dict[str, list[str]]:
    """State-dict name -> the names sharing its tensor (tied weights), every group in state-dict order."""
    ids: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for n, t in state.items():
        ids.setdefault(id(t), []).append(n)
    return {n: names for names in ids.values() for n in names}


__all__ = ["LazyModel", "CheckpointIndex", "TensorEntry", "ST_DTYPES", "CHUNK_BYTES", "state_names"]
