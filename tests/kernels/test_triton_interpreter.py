"""The Triton weight-only kernels checked on CPU through Triton's interpreter (TRITON_INTERPRET=1).

Runs in a subprocess (the interpreter must be chosen before Triton compiles anything) and is skipped
where Triton is not installed.  (Triton 3.6's interpreter needs numpy < 2.4: later numpy refuses its
int() of one-element arrays.)  Bounds: the tile product 1e-2 relative to the reference (bf16 activations;
the interpreter multiplies in fp32); the decode kernel `_wq_gemv`, given activations already in bf16,
1e-5 relative (it multiplies and sums in fp32 on a GPU too: only the order of the sums differs from the
reference's).  On a GPU the same kernels run compiled (tests/kernels/test_gpu_kernels.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = textwrap.dedent("""
    import torch
    from fewbits.kernels.gpu import TritonWeightOnlyKernel, choose_tiles
    from fewbits.kernels import reference_linear
    from fewbits.tensor import quantize_tensor
    worst = 0.0
    for spec, (n, k) in [("int8", (80, 256)), ("int8-asym", (70, 96)), ("int4-g64", (70, 192)),
                         ("int4-g128-asym", (64, 384)), ("int3-g32", (48, 160)), ("int2-g32-asym", (33, 64)),
                         ("int4-g64-asym-zfp16", (48, 128)), ("int3-g32-asym-zbf16", (40, 96)),
                         ("fp8-e4m3", (80, 256)), ("fp8-e4m3-g64", (64, 128)),
                         ("int8-g32", (48, 96)), ("int4-g96", (40, 192)), ("int4", (136, 2048)),
                         ("int4-g64-narrow", (48, 128)), ("int8-narrow", (40, 96))]:
        for m in (1, 5, 19):
            g = torch.Generator().manual_seed(m)
            qt = quantize_tensor(torch.randn(n, k, generator=g), spec)
            if spec.startswith("int") and "asym" not in spec and "narrow" not in spec:
                # the full grid: the end code 0 and negative scales (positive extremes) are there
                assert int(qt.unpacked_codes().min()) == 0 and bool((qt.scale_values() < 0).any()), spec
            x = torch.randn(m, k, generator=g)
            kern = TritonWeightOnlyKernel(qt, device="cpu")
            if qt.fmt.bits in (4, 8):  # the stored codes are what the kernel reads: one copy
                assert kern.q.untyped_storage().data_ptr() == qt.codes.untyped_storage().data_ptr(), spec
            r = reference_linear(x, qt)
            # the tile product: its own tiles, then narrow ones with split-K (partial sums added atomically)
            own = choose_tiles(m, n, k, kern.group, kern.ng == 1, kern.programs)
            for tiles in (own, (16, 16, 32, 3) if m <= 16 else (32, 16, 32, 2)):
                y = kern(x, tiles=tiles).float()
                err = float((y - r).norm() / r.norm())
                assert err < 1e-2, (spec, n, k, m, tiles, err)
                worst = max(worst, err)
    # a split whose last part runs past K (7 K-blocks in splits of 2): scales stored in front of NaNs, so
    # that a read past the last group would show in the output
    qpad = quantize_tensor(torch.randn(40, 224), "int4-g32")
    padded = TritonWeightOnlyKernel(qpad, device="cpu")
    for name in ("s", "m"):
        t = getattr(padded, name)
        big = torch.full((t.numel() + 64,), float("nan"))
        big[:t.numel()] = t.reshape(-1)
        setattr(padded, name, big[:t.numel()].view(t.shape))
    x = torch.randn(1, 224)
    y = padded(x, tiles=(16, 16, 32, 5)).float()
    r = reference_linear(x, qpad)
    assert torch.isfinite(y).all(), "read past the last group"
    assert float((y - r).norm() / r.norm()) < 1e-2
    print("worst", worst)

    # the decode kernel (`_wq_gemv`): the kernel's own pick for <= 8 rows, then K-blocks of several groups (or
    # of part of one), more columns a program than the layer has, and rows masked inside a block of 8
    from fewbits.kernels.gpu import GemvTiles
    worst = 0.0
    for spec, (n, k) in [("int8", (40, 256)), ("int8-asym", (35, 96)), ("int4-g64", (35, 192)),
                         ("int4-g128-asym", (32, 384)), ("int3-g32", (24, 160)), ("int2-g32-asym", (17, 64)),
                         ("int4-g64-asym-zfp16", (24, 128)), ("fp8-e4m3", (40, 256)), ("fp8-e4m3-g64", (32, 128)),
                         ("int4-g96", (20, 192)), ("int4", (40, 2048)), ("int8-g32", (24, 96))]:
        g = torch.Generator().manual_seed(n)
        qt = quantize_tensor(torch.randn(n, k, generator=g), spec)
        kern = TritonWeightOnlyKernel(qt, device="cpu")
        for m, tiles in ((1, None), (8, None), (1, GemvTiles(4, 64)), (5, GemvTiles(64, 256))):
            x = torch.randn(m, k, generator=g).bfloat16().float()  # the kernel reads bf16: no rounding of x
            y = kern(x, tiles=tiles)
            if tiles is None:
                assert isinstance(kern._tiles[m], GemvTiles), (spec, m, kern._tiles[m])
            r = reference_linear(x, qt)
            err = float((y - r).norm() / r.norm())
            assert err < 1e-5, (spec, n, k, m, tiles, err)
            worst = max(worst, err)
    # K not a whole number of words a row (per-channel int4, K = 100): the tile product instead
    qt = quantize_tensor(torch.randn(24, 100), "int4")
    kern = TritonWeightOnlyKernel(qt, device="cpu")
    x = torch.randn(1, 100)
    y = kern(x).float()
    assert not isinstance(kern._tiles[1], GemvTiles)
    assert float((y - reference_linear(x, qt)).norm() / reference_linear(x, qt).norm()) < 1e-2
    # blocks past K (224 columns in blocks of 64 and of 128), on the kernel whose scales lie in front of NaNs
    x = torch.randn(2, 224).bfloat16().float()
    for tiles in (GemvTiles(8, 64), GemvTiles(8, 128)):
        y = padded(x, tiles=tiles)
        assert torch.isfinite(y).all(), ("read past the last group", tiles)
        assert float((y - reference_linear(x, qpad)).norm() / reference_linear(x, qpad).norm()) < 1e-5
    print("gemv worst", worst)

    # inside a compiled graph (the compiled decode step on a GPU): one opaque operator, no graph break, the same
    # output as the eager call for a decode row (the one-row kernel) and a prefill block (the tile product)
    qt = quantize_tensor(torch.randn(48, 256), "int4-g64")
    kern = TritonWeightOnlyKernel(qt, device="cpu")
    step = torch.compile(lambda x: kern(x) * 2, fullgraph=True, dynamic=False)
    for m in (1, 19):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(step(x), kern(x) * 2), m
    print("compiled ok")
""")


def test_triton_weight_only_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "worst" in out.stdout and "gemv worst" in out.stdout and "compiled ok" in out.stdout
