"""The `seed` profile reproduces the published roofline figures for Llama-3-8B on one H100 SXM.

Hand check of the first figure: P_m = 7,504,658,432 linear weights (LM head incl.), d = 4096,
kappa = 2 * 32 * 8 * 128 * 2 B = 128 KiB; batch 1, context 2048 in BF16 reads
2 P_m + 2 d + 2049 kappa = 15,277,891,584 B; / (0.8 * 3.35e12 B/s) + 0.5 ms = 6.2007 ms.
"""

from __future__ import annotations

import pytest

from fewbits.cost import plan

SEED = dict(model="llama-3-8b", device="h100", profile="seed", table_weights=None, table_kv=None)


def _r(weights: str = "bf16", kv: str = "bf16", batch: int = 1, context: int = 2048):
    return plan(batch=batch, context=context, weights=weights, kv=kv, **SEED)


@pytest.mark.parametrize("weights,ms,tok_s", [("bf16", "6.201", "161"), ("int8", "3.400", "294"),
                                              ("int4", "2.000", "500")])
def test_batch1_context2048(weights: str, ms: str, tok_s: str) -> None:
    r = _r(weights)
    assert f"{r.time_s * 1e3:.3f}" == ms
    assert f"{r.tokens_per_s:.0f}" == tok_s
    assert r.bound == "memory"


def test_batch1_bytes_by_hand() -> None:
    r = _r()
    assert r.bytes == 2 * 7_504_658_432 + 2 * 4096 + 2049 * 131072 == 15_277_891_584
    assert r.time_s == pytest.approx(15_277_891_584 / (0.8 * 3.35e12) + 0.5e-3, rel=1e-12)


def test_batch16_context4096_breakdown_and_memory() -> None:
    r = _r(batch=16, context=4096)
    assert f"{r.weight_bytes / 1e9:.2f}" == "15.01"
    assert f"{r.kv_bytes / 1e9:.2f}" == "8.59"
    assert f"{r.time_s * 1e3:.2f}" == "9.31"
    assert f"{r.tokens_per_s:.0f}" == "1719"
    assert r.bound == "memory" and r.speedup == 1.0
    assert f"{r.memory_weights / 1e9:.2f}" == "16.06"  # all weights, embeddings included
    assert f"{r.memory_kv / 1e9:.2f}" == "8.59"
    assert f"{(r.memory_weights + r.memory_kv) / 1e9:.2f}" == "24.65"
    assert r.memory_capacity == 80e9 and r.fits


def test_six_bars() -> None:
    r = plan(batch=16, context=4096, **{**SEED, "table_weights": ("bf16", "int8", "int4"),
                                        "table_kv": ("bf16", "fp8-e4m3")})
    bars = [f"{t.time_s * 1e3:.1f}" for t in r.table]
    assert [(t.weights, t.kv) for t in r.table] == [
        ("bf16", "bf16"), ("bf16", "fp8-e4m3"), ("int8", "bf16"), ("int8", "fp8-e4m3"),
        ("int4", "bf16"), ("int4", "fp8-e4m3")]
    assert bars == ["9.3", "7.7", "6.5", "4.9", "5.1", "3.5"]


def test_batch32_context8192() -> None:
    bf16 = _r(batch=32, context=8192)
    assert f"{bf16.kv_bytes / 1e9:.2f}" == "34.36"
    assert f"{bf16.weight_bytes / 1e9:.2f}" == "15.01"
    assert bf16.kv_bytes > 2 * bf16.weight_bytes
    assert f"{bf16.time_s * 1e3:.2f}" == "18.92"
    fp8_kv = _r(kv="fp8-e4m3", batch=32, context=8192)
    assert f"{fp8_kv.time_s * 1e3:.2f}" == "12.51"
    both = _r(weights="int8", kv="fp8-e4m3", batch=32, context=8192)
    assert f"{both.time_s * 1e3:.2f}" == "9.71"
    assert {bf16.bound, fp8_kv.bound, both.bound} == {"memory"}


def test_crossover_about_115000_tokens() -> None:
    r = _r(batch=16, context=4096)
    assert round(r.crossover_tokens, -3) == 115_000
    assert r.crossover_tokens == pytest.approx(15.01e9 / 131072, rel=1e-3)
