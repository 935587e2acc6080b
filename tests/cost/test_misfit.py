"""Layers whose width the group size does not divide: the cost model counts them as quantisation stores them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fewbits.cli.plan import plan_cmd
from fewbits.cost import DEFAULT, get_device, plan
from fewbits.cost.step import weight_terms
from fewbits.formats.format import FormatError, parse_format
from fewbits.models.presets import get_preset

SMOL = get_preset("smollm2-135m")  # 30 layers; q, k, v, o, gate, up read 576 columns, down 1536
H100 = get_device("h100")


def test_regroup_counts_the_regrouped_bytes():
    """int4-g128 regrouped: 576-wide layers in groups of 96, the 1536-wide down_proj in groups of 128.
    By hand: 4-bit codes r x 576 / 2 bytes plus r x 6 fp16 scales = 300 r bytes for r rows; down_proj
    576 x 1536 / 2 + 576 x 12 x 2 = 456192 bytes."""
    rows_576 = 576 + 192 + 192 + 576 + 1536 + 1536  # q, k, v, o, gate, up
    per_layer = 300 * rows_576 + 456192
    w = weight_terms(SMOL, "int4-g128", H100, DEFAULT, misfit="regroup")
    assert w.dense_q == 30 * per_layer == 30 * 1838592
    assert w.linear_calls == 7 * 30
    # the same model at int4-g64 (fits everywhere): the finer groups cost more scale bytes
    assert weight_terms(SMOL, "int4-g64", H100, DEFAULT).dense_q > w.dense_q


def test_keep_counts_misfits_as_16_bit():
    kept = weight_terms(SMOL, "int4-g128", H100, DEFAULT, misfit="keep")
    full = weight_terms(SMOL, "bf16", H100, DEFAULT)
    assert kept.dense_q == 30 * parse_format("int4-g128").nbytes((576, 1536))  # only down_proj quantised
    rows_576 = 576 + 192 + 192 + 576 + 1536 + 1536
    assert kept.dense_f == pytest.approx(full.dense_f + 30 * rows_576 * 576 * 2)
    assert kept.linear_calls == 7 * 30


def test_error_is_the_default_and_names_the_way_out():
    with pytest.raises(FormatError, match=r"q_proj.*576.*group size 128.*--misfit"):
        weight_terms(SMOL, "int4-g128", H100, DEFAULT)
    with pytest.raises(FormatError, match="misfit policy 'drop'"):
        weight_terms(SMOL, "int4-g128", H100, DEFAULT, misfit="drop")
    r = CliRunner().invoke(plan_cmd, ["-m", "smollm2-135m", "-w", "int4-g128"])
    assert r.exit_code != 0 and "--misfit" in r.output
    r = CliRunner().invoke(plan_cmd, ["-m", "smollm2-135m", "-w", "int4-g128", "--misfit", "regroup", "--json"])
    assert r.exit_code == 0, r.output


def test_plan_regroup_between_g64_and_keep():
    t = {m: plan(SMOL, "h100", 1, 2048, "int4-g128", misfit=m, table_weights=None).time_s for m in ("regroup", "keep")}
    g64 = plan(SMOL, "h100", 1, 2048, "int4-g64", table_weights=None).time_s
    assert g64 > t["regroup"] and t["keep"] > t["regroup"]


def test_fixed_blocks_cannot_regroup():
    assert parse_format("nvfp4").regrouped(100) is None
    assert parse_format("int4-g128").regrouped(576).spec == "int4-g96"
    assert parse_format("int4-g128").regrouped(1536).spec == "int4-g128"
    assert parse_format("int8").regrouped(577).spec == "int8"
