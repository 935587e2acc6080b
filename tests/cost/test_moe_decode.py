"""Decode bytes of mixture-of-experts models: a step reads the experts its tokens are routed to, E (1 -
(1 - k/E)^B) of them per layer at batch B under uniform routing, checked against hand computations."""

from __future__ import annotations

import pytest

from fewbits.cost import SEED, get_device
from fewbits.cost.step import decode, experts_touched, kv_terms, weight_terms
from fewbits.models.presets import get_preset


def _weight_bytes(name: str, weights: str, batch: int) -> float:
    m, dev = get_preset(name), get_device("h100")
    w, k = weight_terms(m, weights, dev, SEED), kv_terms(m, "bf16", SEED)
    return float(decode(m, dev, SEED, w, k, batch, 1)["weight_bytes"])


def test_qwen3_moe_batch1_reads_eight_of_128_experts() -> None:
    L, d = 48, 2048
    attention = L * (2 * 32 * 128 * d + 2 * 4 * 128 * d)  # q, o (32 heads x 128) and k, v (4 KV heads)
    router = L * 128 * d
    head, emb_row = 151936 * d, d
    expert = 3 * d * 768  # gate, up, down of one expert
    assert _weight_bytes("qwen3-30b-a3b", "bf16", 1) == 2 * (attention + router + head + emb_row + L * 8 * expert)
    touched = 128 * (1 - (1 - 8 / 128) ** 16)  # 82.4 distinct experts per layer for 16 tokens
    assert float(experts_touched(get_preset("qwen3-30b-a3b"), 16)) == pytest.approx(touched, rel=1e-12)
    grown = _weight_bytes("qwen3-30b-a3b", "bf16", 16) - _weight_bytes("qwen3-30b-a3b", "bf16", 1)
    assert grown == pytest.approx(2 * ((touched - 8) * L * expert + 15 * emb_row), rel=1e-12)


def test_qwen2_moe_reads_its_shared_expert_every_step() -> None:
    L, d = 24, 2048
    attention = L * 4 * d * d
    shared = L * 3 * d * 5632
    gates = L * (60 * d + d)  # the router and the shared expert's one-row gate, 16-bit
    expert = 3 * d * 1408
    head = 151936 * d
    want = 2 * (attention + shared + gates + head + d + L * 4 * expert)
    assert _weight_bytes("qwen1.5-moe-a2.7b", "bf16", 1) == want
