"""Scratch matrices reused inside a calibration run: reuse, scoping, and results unchanged by dirty buffers."""

from __future__ import annotations

import threading

import torch

from fewbits.methods import workspace
from fewbits.methods.gptq import gptq_quantize


def test_released_matrices_are_handed_out_again_only_inside_active() -> None:
    a = workspace.empty(512, 512)
    workspace.release(a)  # outside: nothing is kept
    assert workspace.pooled_bytes() == 0
    with workspace.active():
        b = workspace.empty(512, 512)
        ptr = b.data_ptr()
        workspace.release(b)
        assert workspace.pooled_bytes() == 512 * 512 * 4
        assert workspace.empty(512, 256, 2).data_ptr() != ptr  # another shape: a new one
        assert workspace.empty(512, 512, dtype=torch.float64).data_ptr() != ptr  # another dtype too
        c = workspace.empty(512, 512)
        assert c.data_ptr() == ptr and workspace.pooled_bytes() == 0
        with workspace.active():  # nested: the same pool
            workspace.release(c)
        assert workspace.pooled_bytes() == 512 * 512 * 4
    assert workspace.pooled_bytes() == 0  # dropped with the block


def test_small_tensors_views_and_other_threads_are_not_pooled() -> None:
    with workspace.active():
        big = torch.empty(1024, 1024)
        workspace.release(torch.empty(16, 16), big[:512], big.T)  # small, a view, not contiguous
        assert workspace.pooled_bytes() == 0
        workspace.release(big)
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(workspace.pooled_bytes()))
        t.start()
        t.join()
        assert seen == [0] and workspace.pooled_bytes() == 1024 * 1024 * 4


def test_gptq_gives_the_same_codes_on_reused_dirty_buffers() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 1024, generator=g)  # big enough to be pooled
    H = x.T @ x / 2048
    ws = [torch.randn(384, 1024, generator=g) for _ in range(3)]
    want = [gptq_quantize(w, H, "int4-g64", act_order=True) for w in ws]
    with workspace.active():
        for _ in range(2):  # the second round runs on buffers the first one left behind
            for w, ref in zip(ws, want, strict=True):
                got = gptq_quantize(w, H, "int4-g64", act_order=True)
                assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale)
                workspace.release(torch.full((1024, 1024), float("nan")))  # a poisoned buffer, reused next
        assert workspace.pooled_bytes() > 0  # they were reused, not just allocated anew
