"""One safetensors file written a tensor at a time, so that the whole file is never in memory.

    w = TensorFileWriter(tmp / "model.safetensors", n_tensors_hint=2000)
    w.add("model.layers.0.mlp.up_proj.qweight_codes", codes)      # data goes to disk at once
    w.add_pieces("model.embed_tokens.weight", torch.bfloat16, (V, H), rows_of_the_embedding)
    w.close({"fewbits": "..."})                                    # the header, then the file is complete

The file is the format safetensors' own `save_file` writes and every safetensors reader accepts: an
8-byte little-endian header length, a JSON header (dtype, shape, byte range of each tensor; padded with
spaces, as `save_file` pads it), then the tensors' bytes back to back.  The header comes first but is
known last, so room for it is reserved when the file is opened (`n_tensors_hint` entries of the longest
name) and filled in by `close`; a header that outgrows the room is written in front of a copy of the data
(the rare case costs one pass over the file).  Tensors lie in the order they were added, not in
`save_file`'s order (by dtype, then name): readers look tensors up by name, so only the bytes differ.
Atomicity is the caller's: this writes inside a temporary folder of `fewbits.files.write_dir`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

#: torch dtypes -> safetensors dtype names
ST_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
#: reserved header bytes per expected tensor, on top of its name
ENTRY_BYTES = 96
COPY_BYTES = 64 << 20


class TensorFileWriter:
    """Appends tensors to a new safetensors file; `close` writes the header.  Names must be unique."""

    def __init__(self, path: str | os.PathLike[str], n_tensors_hint: int = 1024, longest_name: int = 128) -> None:
        self.path = Path(path)
        self.reserve = _round8(n_tensors_hint * (longest_name + ENTRY_BYTES) + 4096)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self._f = open(self.path, "wb")  # noqa: SIM115  (kept open until close)
        self._f.write(b"\0" * (8 + self.reserve))

    @property
    def nbytes(self) -> int:
        """Tensor bytes written so far."""
        return self.offset

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write tensor `t` (any device) under `name`."""
        t = t.detach().to("cpu").contiguous()
        self.add_pieces(name, t.dtype, tuple(t.shape), [t])

    def add_pieces(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], pieces: Iterable[torch.Tensor]) -> None:
        """Write one tensor of `dtype` and `shape` given as consecutive pieces (e.g. row ranges) in order."""
        if name in self.entries:
            raise ValueError(f"tensor {name} is written twice")
        if dtype not in ST_NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} has no safetensors name")
        start = self.offset
        for p in pieces:
            if p.dtype != dtype:
                raise ValueError(f"tensor {name}: a piece of dtype {p.dtype}, the tensor is {dtype}")
            p = p.detach().to("cpu").contiguous().reshape(-1)
            if p.numel():
                self._f.write(memoryview(p.view(torch.uint8).numpy()))
                self.offset += p.numel() * p.element_size()
        want = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.offset - start != want:
            raise ValueError(f"tensor {name}: pieces hold {self.offset - start} bytes, shape {shape} needs {want}")
        self.entries[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [start, self.offset]}

    def close(self, metadata: dict[str, str] | None = None) -> Path:
        """Write the header; the file is complete and flushed to disk after this."""
        head: dict = {"__metadata__": metadata} if metadata else {}
        head.update(self.entries)
        raw = json.dumps(head, separators=(",", ":")).encode()
        if len(raw) <= self.reserve:
            self._f.seek(0)
            self._f.write(struct.pack("<Q", self.reserve) + raw + b" " * (self.reserve - len(raw)))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            return self.path
        self._f.close()  # the header outgrew its room: write it in front of a copy of the data
        size = _round8(len(raw))
        moved = self.path.with_name(self.path.name + ".new")
        with open(self.path, "rb") as src, open(moved, "wb") as dst:
            dst.write(struct.pack("<Q", size) + raw + b" " * (size - len(raw)))
            src.seek(8 + self.reserve)
            while chunk := src.read(COPY_BYTES):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(moved, self.path)
        return self.path

    def abort(self) -> None:
        """Close without a header (the caller's temporary folder is removed)."""
        if not self._f.closed:
            self._f.close()


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` as safetensors can write it: contiguous and alone in its storage.  A view of a larger tensor (the
    row views the fused decode leaves in a model's layers, `fewbits.decode.fuse`) is copied; safetensors
    refuses tensors that share memory."""
    t = t.contiguous()
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _round8(n: int) -> int:
    return -(-n // 8) * 8


__all__ = ["TensorFileWriter", "ST_NAMES", "owned"]
