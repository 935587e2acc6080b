"""The vectorised sweep agrees element by element with the scalar plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fewbits.cost import plan, sweep
from fewbits.cost.sweep import format_sweep_table, summarize


@pytest.mark.parametrize("profile,devices", [("seed", 1), ("default", 2)])
def test_sweep_equals_plan(profile: str, devices: int) -> None:
    weights, kv = ("bf16", "fp8-e4m3", "int4-g128"), ("bf16", "int4-g32-asym")
    batch, context = (1, 7, 64), (100, 4096)
    res = sweep("qwen2.5-7b", "h100", batch, context, weights, kv, devices, profile)
    assert res.time.shape == (3, 2, 3, 2) and res.size == 36
    for (i, w), (j, k), (bi, b), (ci, c) in itertools.product(*(list(enumerate(x)) for x in
                                                                (weights, kv, batch, context))):
        r = plan("qwen2.5-7b", "h100", b, c, w, k, devices, profile, table_weights=None)
        assert res.time[i, j, bi, ci] == pytest.approx(r.time_s, rel=1e-12)
        assert res.fits[i, j, bi, ci] == r.fits
        assert bool(res.compute_bound[i, j, bi, ci]) == (r.bound == "compute")


def test_large_sweep_shapes_and_monotonicity() -> None:
    res = sweep("llama-3-8b", "h100", np.arange(1, 65), np.arange(512, 32769, 512), ("bf16", "int4-g128"))
    assert res.size == 2 * 64 * 64
    assert (np.diff(res.time, axis=3) > 0).all()  # longer context, longer step
    assert (res.time[1] < res.time[0]).all()  # int4 weights always faster than bf16
    with pytest.raises(ValueError, match="positive"):
        sweep("llama-3-8b", "h100", [0, 1], [16])


def test_summary_lines() -> None:
    res = sweep("llama-3-8b", "h100", (1, 8), (64, 8192), profile="seed")
    lines = summarize(res, "llama-3-8b", "h100", profile="seed", max_batch=1024)
    text = "\n".join(lines)
    assert "batch 1: the cache outweighs the weights beyond 114,512 tokens" in text
    assert "context 8192: compute-bound never up to batch 1024" in text
    hit = [ln for ln in lines if ln.strip().startswith("context 64:")][0]
    first = int(hit.split("from batch ")[1].split()[0])
    r = plan("llama-3-8b", "h100", first, 64, profile="seed", table_weights=None)
    before = plan("llama-3-8b", "h100", first - 1, 64, profile="seed", table_weights=None)
    assert r.bound == "compute" and before.bound == "memory"
    assert len(format_sweep_table(res).splitlines()) == 1 + 4
