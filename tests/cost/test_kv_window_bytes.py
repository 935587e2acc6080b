"""The cost model counts a KV cache's bytes exactly as the store holds them, 16-bit window included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits.cost.plan import plan
from fewbits.cost.profile import DEFAULT
from fewbits.cost.step import kv_cache_bytes, kv_terms
from fewbits.formats.kvformat import KV_SPECS, parse_kv_format, quantized_tokens
from fewbits.kvcache.store import KVStore
from fewbits.models.spec import ModelSpec

SPEC = ModelSpec(name="kvtiny", family="llama", n_layers=3, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=64,
                 intermediate_size=256, vocab_size=512, tie_embeddings=True, max_position_embeddings=4096)
CONTEXTS = (1, 127, 128, 129, 160, 512, 2048)
FORMATS = (*KV_SPECS, "fp16", "int4-g64-r64", "int2-g128-r32", "int8-r16", "int4-r0")


def _store_bytes(spec: str, tokens: int, batch: int) -> int:
    """Bytes the store reports after a prefill of tokens - 1 and one decode-step write, all layers."""
    torch.manual_seed(0)
    st = KVStore(spec, batch, SPEC.n_kv_heads, SPEC.head_dim, tokens, dtype=torch.bfloat16)
    for n in ((tokens - 1, 1) if tokens > 1 else (1,)):
        k = torch.randn(batch, SPEC.n_kv_heads, n, SPEC.head_dim, dtype=torch.bfloat16)
        st.append(k, -k)
    return SPEC.n_layers * st.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_cost_model_kv_bytes_equal_the_store(fmt: str) -> None:
    kvf = parse_kv_format(fmt)
    terms = kv_terms(SPEC, kvf.full_spec, DEFAULT)
    assert parse_kv_format(kvf.full_spec) == kvf and terms.spec == kvf.full_spec
    for c in CONTEXTS:
        want = _store_bytes(fmt, c, batch=2)
        assert want == kvf.nbytes(c, SPEC.n_layers, SPEC.n_kv_heads, SPEC.head_dim, batch=2)
        q, w = kv_cache_bytes(terms, c)
        assert 2 * (float(q) + float(w)) == want, (fmt, c)
        r = plan(SPEC, "h100", batch=2, context=c, kv=kvf.full_spec, table_weights=None, table_kv=None)
        assert r.memory_kv == want, (fmt, c)
        assert r.kv == kvf.full_spec


def test_kivi_window_hand_counted() -> None:
    """int4, G = 32, R = 128, head dim 64, one layer and head: 160 tokens -> 32 quantised + 128 in 16 bits."""
    kvf = parse_kv_format("int4")
    assert kvf.quantized_tokens(160) == 32 and kvf.quantized_tokens(159) == 0 and kvf.quantized_tokens(1) == 0
    codes = 2 * 32 * 32  # keys + values, 32 bytes of 4-bit codes per token
    key_groups = 1 * 64 * 4  # one (scale, min) fp16 pair per channel for the one group of 32 tokens
    value_groups = 32 * 2 * 4  # per token: 64 channels / 32 = 2 (scale, min) pairs
    window = 2 * 128 * 64 * 2
    assert kvf.head_bytes(160, 64) == codes + key_groups + value_groups + window
    # the cost model's decode step at 160 tokens: the quantised part streams at int4's efficiency, the
    # window at the 16-bit cache's
    t = kv_terms(SPEC, "int4-g32-r128", DEFAULT)
    assert t.per_token == SPEC.n_layers * SPEC.n_kv_heads * (codes + key_groups + value_groups) / 32
    assert t.window_per_token == SPEC.n_layers * SPEC.n_kv_heads * 2 * 64 * 2
    assert t.eta == DEFAULT.kv_eff("int4") and t.window_eta == DEFAULT.kv_eff("float")


def test_window_rule_is_elementwise_and_shared() -> None:
    ctx = np.array([1, 127, 128, 129, 160, 191, 192, 2048], dtype=float)
    got = quantized_tokens(ctx, 128, 32)
    assert got.tolist() == [0, 0, 0, 0, 32, 32, 64, 1920]
    kvf = parse_kv_format("int2")
    assert [kvf.quantized_tokens(int(c)) for c in ctx] == got.tolist()


def test_weight_style_kv_specs_keep_their_meaning() -> None:
    """Bare specs that are weight formats (int4, fp8-e4m3) keep the asymptotic figure without a window."""
    t = kv_terms(SPEC, "int4", DEFAULT)
    assert t.residual == 0 and t.block == 1 and t.per_token == 2 * 3 * 2 * 64 * 4 / 8
    q, w = kv_cache_bytes(t, 129)
    assert float(q) == 129 * t.per_token and float(w) == 0
    with pytest.raises(ValueError, match="format 'int4-x3': cannot read the suffix 'x3'"):
        kv_terms(SPEC, "int4-x3", DEFAULT)


def test_sweep_broadcasts_windowed_caches_like_plan() -> None:
    from fewbits.cost.sweep import sweep

    kvs = ("bf16", "int4-g32-r128", "int8-r0", "fp8-e4m3")
    res = sweep("smollm2-135m", "h100", (1, 8), (100, 130, 512), ("bf16", "int4-g64"), kvs)
    for j, kv in enumerate(kvs):
        for ci, c in enumerate(res.context):
            p = plan("smollm2-135m", "h100", batch=8, context=int(c), weights="int4-g64", kv=kv,
                     table_weights=None, table_kv=None)
            assert p.time_s == pytest.approx(float(res.time[1, j, 1, ci]), rel=1e-12)
            assert p.kv_bytes == pytest.approx(float(res.kv_bytes[1, j, 1, ci]), rel=1e-12)
    # at 130 tokens a KIVI int4 cache is all window: as many bytes as the 16-bit one
    assert res.kv_bytes[0, 1, 0, 1] == res.kv_bytes[0, 0, 0, 1]


def test_measured_window_rate_and_dequantisation_apply_to_windowed_caches() -> None:
    from dataclasses import replace

    from fewbits.cost.profile import Profile

    prof = replace(DEFAULT, kv_quantized_overhead_s={"int4": 1e-4}, kv_window_bandwidth_efficiency={"int4": 0.2})
    prof = Profile.from_dict(prof.to_dict())  # the new tables survive JSON
    t = kv_terms(SPEC, "int4-g32-r128", prof)
    assert t.window_eta == 0.2 and t.quantized_overhead_s == 1e-4
    assert kv_terms(SPEC, "bf16", prof).quantized_overhead_s == 0 and kv_terms(SPEC, "bf16", prof).window_eta == 0.8

    def over(c: int, kv: str = "int4-g32-r128") -> float:
        return plan(SPEC, "h100", batch=1, context=c, kv=kv, profile=prof, table_weights=None, table_kv=None).overhead_s

    # 150 cached tokens + the new one: all in the window; 159 + 1 = 160: the first group is quantised
    assert over(150) == over(100) and over(159) == pytest.approx(over(100) + SPEC.n_layers * 1e-4)
    with pytest.raises(ValueError, match="kv_window_bandwidth_efficiency"):
        replace(DEFAULT, kv_window_bandwidth_efficiency={"int4": 1.5})
