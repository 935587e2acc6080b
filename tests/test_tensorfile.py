"""TensorFileWriter: files safetensors' own reader (and fewbits' header check) reads back exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fewbits.models.loading import read_safetensors_header
from fewbits.tensorfile import TensorFileWriter, owned


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=g), "codes": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
            "s": torch.tensor(3.0, dtype=torch.bfloat16), "empty": torch.empty(0, 4),
            "mask": torch.tensor([True, False, True]), "h": torch.randn(4, 2, generator=g).half(),
            "i": torch.arange(6, dtype=torch.int64).reshape(2, 3)}


@pytest.mark.parametrize("hint", [64, 0])  # room enough for the header; none (the header is moved in front)
def test_round_trip_through_safetensors(tmp_path, hint):
    path = tmp_path / "x.safetensors"
    w = TensorFileWriter(path, n_tensors_hint=hint, longest_name=0)
    if hint == 0:
        assert w.reserve == 4096
        w.reserve = 8  # smaller than any header: the header is written in front of a copy of the data
        w._f.seek(0)
        w._f.truncate()
        w._f.write(b"\0" * 16)
    ts = _tensors()
    for k, v in ts.items():
        w.add(k, v)
    w.close({"fewbits": "{}"})
    got = load_file(path)
    assert sorted(got) == sorted(ts)
    for k, v in ts.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"fewbits": "{}"}
    read_safetensors_header(path)  # fewbits' own check: every byte accounted for
    assert w.nbytes == sum(v.numel() * v.element_size() for v in ts.values())


def test_pieces_make_one_tensor(tmp_path):
    full = torch.randn(10, 4).to(torch.bfloat16)
    w = TensorFileWriter(tmp_path / "p.safetensors")
    w.add_pieces("t", torch.bfloat16, (10, 4), [full[:3], full[3:7], full[7:]])
    w.close()
    assert torch.equal(load_file(tmp_path / "p.safetensors")["t"], full)


def test_wrong_pieces_and_names_are_refused(tmp_path):
    w = TensorFileWriter(tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="pieces hold 24 bytes, shape"):
        w.add_pieces("t", torch.float32, (10,), [torch.zeros(6)])
    with pytest.raises(ValueError, match="a piece of dtype torch.float16"):
        w.add_pieces("u", torch.float32, (2,), [torch.zeros(2, dtype=torch.float16)])
    w.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="tensor a is written twice"):
        w.add("a", torch.zeros(2))
    w.abort()


def test_owned_copies_views_and_passes_whole_tensors() -> None:
    """Row views of one matrix (the fused decode's layers) come out alone in their storage; a whole
    contiguous tensor is returned as is (no copy)."""
    w = torch.arange(24.0).reshape(6, 4)
    whole = owned(w)
    assert whole is w
    parts = [owned(w[:2]), owned(w[2:])]
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in parts)
    assert parts[0].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    assert torch.equal(torch.cat(parts), w)
    t = owned(w.t())  # not contiguous: one contiguous copy
    assert t.is_contiguous() and torch.equal(t, w.t())
