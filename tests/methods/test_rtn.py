"""Round-to-nearest against llama.cpp's reference quantisers as the `gguf` package implements them:
int4-g32 (the full grid) is Q4_0 and int8-g32-narrow is Q8_0, codes and fp16 scales byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits.methods.rtn import rtn_quantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _weights(rows: int = 96, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Heavy-tailed float32 weights with the cases that decide a quantiser: outliers of both signs, a group
    whose extremes tie in magnitude (+x and -x: the first one sets the sign), values exactly half a step
    apart on a power-of-two scale (ties), and an all-zero group."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, (rows, cols)) * 0.02).astype(np.float32)
    w[1, 3], w[2, 70] = 0.4, -0.4
    w[3, :32] = 0.01
    w[3, 5], w[3, 9] = 0.25, -0.25  # tie in magnitude, the positive one first
    w[4, 32:64] = 0.0
    w[4, 32] = -1.0  # the extreme: d = -1 / -8 = 0.125, a power of two, so x / d below is exact
    w[4, 33:49] = (np.arange(-8, 8, dtype=np.float32) + 0.5) * 0.125  # each exactly between two codes
    w[5, 64:96] = 0.0
    return w


def _q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (rows, cols) 0..15, fp16 scales (rows, cols / 32)) of gguf's Q4_0 quantiser."""
    rows, cols = w.shape
    b = gguf.quants.quantize(w, Q.Q4_0).reshape(rows, cols // 32, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    qs = b[..., 2:]
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols), d


def _q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (rows, cols) as q + 128, fp16 scales) of gguf's Q8_0 quantiser."""
    rows, cols = w.shape
    b = gguf.quants.quantize(w, Q.Q8_0).reshape(rows, cols // 32, 34)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    q = b[..., 2:].copy().view(np.int8).reshape(rows, cols).astype(np.int32) + 128
    return q, d


def _nonzero_groups(w: np.ndarray) -> np.ndarray:
    return np.abs(w.reshape(w.shape[0], -1, 32)).max(-1) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_int4_g32_is_q4_0_byte_for_byte(seed):
    w = _weights(seed=seed)
    res = rtn_quantize(torch.from_numpy(w), "int4-g32")
    codes, d = _q4_0(w)
    assert np.array_equal(res.codes.numpy(), codes)
    scales = res.scale.to(torch.float16).numpy()
    nz = _nonzero_groups(w)
    assert np.array_equal(scales[nz].view(np.uint16), d[nz].view(np.uint16))
    # an all-zero group: gguf stores d = 0, fewbits a scale of 1 (its codes are all 8: both decode to 0)
    assert np.all(d[~nz] == 0) and np.all(scales[~nz] == 1) and (~nz).sum() == 1
    assert (res.codes == 0).any() and (res.scale < 0).any()  # the end code and signed scales are used


def test_int8_g32_narrow_is_q8_0_and_the_full_grid_is_not():
    w = _weights()
    codes, d = _q8_0(w)
    nz = _nonzero_groups(w)
    narrow = rtn_quantize(torch.from_numpy(w), "int8-g32-narrow")
    assert np.array_equal(narrow.codes.numpy(), codes)
    assert np.array_equal(narrow.scale.to(torch.float16).numpy()[nz].view(np.uint16), d[nz].view(np.uint16))
    full = rtn_quantize(torch.from_numpy(w), "int8-g32")  # d = x_e / -128: other scales, other codes
    assert not np.array_equal(full.codes.numpy(), codes)


def test_narrow_grid_never_uses_the_end_code_and_the_full_grid_uses_it_in_every_group():
    w = torch.from_numpy(_weights())
    narrow = rtn_quantize(w, "int4-g64-narrow")
    assert int(narrow.codes.min()) == 1 and int(narrow.codes.max()) == 15 and bool((narrow.scale > 0).all())
    full = rtn_quantize(w, "int4-g64")
    per_group = (full.codes.reshape(96, -1, 64) == 0).sum(-1)
    nz = torch.from_numpy(np.abs(_weights().reshape(96, -1, 64)).max(-1) > 0)
    assert bool((per_group[nz] >= 1).all())
