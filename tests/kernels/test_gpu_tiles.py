"""Tile and group rules of the Triton weight-only kernel (plain Python: they run without a GPU or Triton)."""

from __future__ import annotations

import pytest

from fewbits.formats.format import parse_format
from fewbits.kernels.gpu import _group_ok, choose_tiles


def test_decode_tiles_split_k_until_the_device_is_busy():
    # H200: 132 multiprocessors, 264 programs; split until ~1056 programs, at most 8 splits
    # 14336 x 4096 (up projection): 224 column tiles of 64 -> split 5
    assert choose_tiles(1, 14336, 4096, 4096, True, 264) == (16, 64, 128, 5)
    # 4096 x 14336 (down projection): 64 tiles -> 8 splits
    assert choose_tiles(1, 4096, 14336, 14336, True, 264) == (16, 64, 128, 8)
    # the split never exceeds the K-blocks there are (4 x 128 for K = 512)
    assert choose_tiles(1, 8192, 512, 512, True, 264)[3] == 4


def test_small_weights_do_not_split():
    # SmolLM2's largest linear (1536 x 576): the split's two extra launches would cost more than they save
    assert choose_tiles(1, 1536, 576, 64, False, 264)[3] == 1


@pytest.mark.parametrize(("group", "block_k"), [(128, 128), (64, 64), (96, 32), (32, 32), (48, 16)])
def test_a_k_block_lies_inside_one_group(group, block_k):
    bm, bn, bk, _ = choose_tiles(1, 4096, group * 8, group, False, 264)
    assert bk == block_k and group % bk == 0


def test_prefill_tiles_do_not_split():
    assert choose_tiles(512, 4096, 4096, 128, False, 264) == (64, 64, 64, 1)


def test_group_rules_name_the_group():
    assert _group_ok(parse_format("int4-g128")) is None
    assert _group_ok(parse_format("int8")) is None
    assert _group_ok(parse_format("int8-g48")) is None  # 8-bit: a K-block of 16 codes
    assert "48 is not a multiple of 32" in _group_ok(parse_format("int4-g48"))
    assert "24 is not a multiple of 16" in _group_ok(parse_format("fp8-e4m3-g24"))
