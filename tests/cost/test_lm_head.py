"""The LM head in its own format (`fewbits quantize --lm-head`): bytes read per step and bytes held."""

from __future__ import annotations

import pytest

from fewbits.cost import DEFAULT, get_device, plan
from fewbits.cost.plan import format_plan_text
from fewbits.cost.step import weight_terms
from fewbits.models.presets import get_preset

H100 = get_device("h100")
SMOL = get_preset("smollm2-135m")  # head 49152 x 576, tied to the embedding
LLAMA = get_preset("llama-3-8b")  # head 128256 x 4096, untied


def test_int8_head_bytes_by_hand():
    """int8 per channel: one byte a weight plus one fp16 scale a row: 49152 x 576 + 49152 x 2 bytes."""
    head8 = 49152 * 576 + 49152 * 2
    w = weight_terms(SMOL, "int4-g64", H100, DEFAULT, lm_head="int8")
    plain = weight_terms(SMOL, "int4-g64", H100, DEFAULT)
    assert w.head_q == head8 == 28_409_856
    assert plain.head_q == 0 and plain.dense_f - w.dense_f == 49152 * 576 * 2  # the bf16 head left dense_f
    assert w.dense_q == plain.dense_q
    # tied: the embedding keeps its 16-bit rows, so memory holds the int8 copy on top
    assert w.stored - plain.stored == head8
    # untied: the int8 head replaces the bf16 one
    l8 = weight_terms(LLAMA, "int4-g128", H100, DEFAULT, lm_head="int8")
    l16 = weight_terms(LLAMA, "int4-g128", H100, DEFAULT)
    assert l16.stored - l8.stored == 128256 * 4096 * 2 - (128256 * 4096 + 128256 * 2)


def test_a_quantised_head_makes_the_step_faster_and_a_16_bit_one_changes_nothing():
    t = {h: plan(SMOL, "h100", 1, 2048, "int4-g64", lm_head=h, table_weights=None) for h in (None, "bf16", "int8",
                                                                                             "int4-g64")}
    assert t["bf16"].time_s == pytest.approx(t[None].time_s)
    assert t[None].time_s > t["int8"].time_s > t["int4-g64"].time_s
    assert t["int8"].weight_bytes == pytest.approx(t[None].weight_bytes - 49152 * 576 * 2 + 28_409_856)
    assert t["int8"].lm_head == "int8" and "LM head int8" in format_plan_text(t["int8"])
