"""The step model beyond the seed figures: calibrated efficiencies, prefill roofs, tensor parallelism,
mixture-of-experts, memory limits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT, SEED, get_device, plan
from fewbits.cost.step import decode, experts_touched, kv_terms, weight_terms
from fewbits.models.presets import get_preset

NO_TABLE = dict(table_weights=None, table_kv=None)


@pytest.mark.parametrize("context", [512, 2048])
def test_default_profile_matches_measured_batch1_speedups(context: int) -> None:
    """TensorRT-LLM, Llama-3-8B, one H100, batch 1: FP8 1.26x and INT4-AWQ 1.53x over BF16."""
    fp8 = plan("llama-3-8b", "h100", 1, context, "fp8-e4m3", **NO_TABLE)
    awq = plan("llama-3-8b", "h100", 1, context, "int4-g128", **NO_TABLE)
    assert fp8.speedup == pytest.approx(1.26, rel=0.10)
    assert awq.speedup == pytest.approx(1.53, rel=0.10)


def test_bytes_alone_suggest_more_than_measured() -> None:
    """With every byte at the same efficiency (no dequantisation cost) the same conventions give the
    'bytes alone' speedups of about 1.7x and 2.6x."""
    flat = replace(DEFAULT, name="flat", bandwidth_efficiency=dict.fromkeys(DEFAULT.bandwidth_efficiency, 0.8),
                   overhead_s=0.5e-3)
    fp8 = plan("llama-3-8b", "h100", 1, 2048, "fp8-e4m3", profile=flat, **NO_TABLE)
    awq = plan("llama-3-8b", "h100", 1, 2048, "int4-g128", profile=flat, **NO_TABLE)
    assert fp8.speedup == pytest.approx(1.7, abs=0.06)
    assert awq.speedup == pytest.approx(2.6, abs=0.1)
    assert DEFAULT.bw_eff("int4") < DEFAULT.bw_eff("fp8") < DEFAULT.bw_eff("float")


def test_prefill_w8a8_raises_the_roof_only_where_units_exist() -> None:
    ctx = 4096
    bf16 = plan("llama-3-8b", "h100", 1, ctx, **NO_TABLE)
    fp8 = plan("llama-3-8b", "h100", 1, ctx, "fp8-e4m3", **NO_TABLE)
    awq = plan("llama-3-8b", "h100", 1, ctx, "int4-g128", **NO_TABLE)
    assert fp8.precision == "fp8" and awq.precision == "bf16"
    assert fp8.ttft_s < 0.6 * bf16.ttft_s  # 2x the peak, slightly lower efficiency
    assert awq.ttft_s >= 0.98 * bf16.ttft_s  # weight-only: no faster maths
    a100_fp8 = plan("llama-3-8b", "a100", 1, ctx, "fp8-e4m3", **NO_TABLE)
    a100_bf16 = plan("llama-3-8b", "a100", 1, ctx, **NO_TABLE)
    assert a100_fp8.precision == "bf16" and a100_fp8.ttft_s >= 0.98 * a100_bf16.ttft_s
    assert any("no fp8 units" in n for n in a100_fp8.notes)
    w8a8 = plan("llama-3-8b", "a100", 1, ctx, "int8", activations="int8", **NO_TABLE)
    # linears on int8 units at twice the rate; attention (7% of the FLOPs at 4096 tokens) stays 16-bit
    assert w8a8.precision == "int8" and w8a8.ttft_s < 0.65 * a100_bf16.ttft_s
    # the seed profile keeps BF16 maths everywhere
    assert plan("llama-3-8b", "h100", 1, ctx, "fp8-e4m3", profile="seed", **NO_TABLE).precision == "bf16"


def test_prefill_flops_by_hand() -> None:
    m, dev = get_preset("llama-3-8b"), get_device("h100")
    r = plan(m, dev, 1, 4096, profile="seed", **NO_TABLE)
    p = 4096
    flops = 2 * 7_504_658_432 * p + 4 * 32 * 4096 * p * (p + 1) / 2
    assert r.ttft_s == pytest.approx(flops / (989.4e12 * 0.8) + 0.5e-3, rel=1e-9)  # compute-bound


def test_tensor_parallel_two_allreduces_per_layer() -> None:
    one = plan("llama-3-8b", "h100", 16, 4096, profile="seed", **NO_TABLE)
    two = plan("llama-3-8b", "h100", 16, 4096, devices=2, profile="seed", **NO_TABLE)
    allreduce = 2 * (2 - 1) / 2 * 16 * 4096 * 2 / 450e9 + 8e-6
    assert two.t_comm_s == pytest.approx(2 * 32 * allreduce, rel=1e-12)
    assert two.time_s == pytest.approx((one.time_s - 0.5e-3) / 2 + two.t_comm_s + 0.5e-3, rel=1e-9)
    assert two.memory_capacity == 160e9 and two.bytes == pytest.approx(one.bytes, rel=1e-12)
    # more devices than KV heads: the cache is replicated, not split further
    m = get_preset("llama-3-8b")
    assert kv_terms(m, "bf16", SEED, 16).per_token == kv_terms(m, "bf16", SEED, 8).per_token


def test_moe_decode_reads_the_experts_it_touches() -> None:
    m, dev = get_preset("mixtral-8x7b"), get_device("h100")
    assert float(experts_touched(m, 1)) == pytest.approx(2.0)
    assert float(experts_touched(m, 64)) == pytest.approx(8.0, abs=1e-6)
    w, k = weight_terms(m, "bf16", dev, SEED), kv_terms(m, "bf16", SEED)
    b1 = float(decode(m, dev, SEED, w, k, 1, 1)["weight_bytes"])
    b64 = float(decode(m, dev, SEED, w, k, 64, 1)["weight_bytes"])
    expert = 3 * 4096 * 14336 * 2 * 32  # one expert in every layer, BF16 bytes
    assert b64 - b1 == pytest.approx(6 * expert + 63 * 4096 * 2, rel=1e-6)
    r = plan("mixtral-8x7b", "h100", 1, 128, profile="seed", devices=2, **NO_TABLE)
    assert r.memory_weights == pytest.approx(2 * 46_702_792_704, rel=1e-12)


def test_memory_limits_are_tight() -> None:
    r = plan("llama-3-8b", "h100", 16, 4096, **NO_TABLE)
    usable = 80e9 * 0.9
    kv_tok = 131072
    assert r.max_batch == (usable - r.memory_weights) // (4096 * kv_tok)
    assert r.max_context == (usable - r.memory_weights) // (16 * kv_tok)
    assert plan("llama-3-8b", "h100", r.max_batch, 4096, **NO_TABLE).fits
    assert not plan("llama-3-8b", "h100", r.max_batch + 1, 4096, **NO_TABLE).fits
    big = plan("llama-3-70b", "l4", 1, 128, **NO_TABLE)
    assert not big.weights_fit and not big.fits and big.max_batch == 0


def test_exact_bytes_include_scales_and_bf16_lm_head() -> None:
    m, dev = get_preset("llama-3-8b"), get_device("h100")
    w = weight_terms(m, "int4-g128", dev, DEFAULT)
    body = m.n_linear_params(("attention", "mlp"))
    assert w.dense_q == body * 4.125 / 8  # every in_features divides by 128: exact == asymptotic
    assert w.dense_f == 128256 * 4096 * 2 + (m.n_norm_params + m.n_bias_params) * 2
    with pytest.raises(ValueError, match="not divisible by the group size 100"):
        weight_terms(m, "int4-g100", dev, DEFAULT)


def test_bad_sizes_are_errors() -> None:
    for kw in ({"batch": 0}, {"context": -1}, {"devices": 0}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            plan("llama-3-8b", "h100", **{"batch": 1, "context": 16, **kw})


def test_kv_bits_per_value_come_from_the_format() -> None:
    m = get_preset("llama-3-8b")
    bits = {k: kv_terms(m, k, DEFAULT).bits for k in ("bf16", "fp16", "fp8-e4m3", "fp8-e5m2", "int8", "int4",
                                                       "int2", "int4-g32-asym", "int2-g32-asym")}
    assert bits == {"bf16": 16, "fp16": 16, "fp8-e4m3": 8, "fp8-e5m2": 8, "int8": 8, "int4": 4, "int2": 2,
                    "int4-g32-asym": 4 + (16 + 4) / 32, "int2-g32-asym": 2 + (16 + 2) / 32}
    assert kv_terms(m, "int2", DEFAULT).per_token == 2 * 32 * 8 * 128 * 2 / 8


def test_tied_embeddings_stored_once() -> None:
    m, dev = get_preset("smollm2-135m"), get_device("l4")
    assert weight_terms(m, "bf16", dev, DEFAULT).stored == 2 * 134_515_008
    assert weight_terms(m, "bf16", dev, SEED).stored == 2 * 134_515_008
