"""Tile and group rules of the Triton weight-only kernels (plain Python: they run without a GPU or Triton)."""

from __future__ import annotations

import pytest
import torch

from fewbits.formats.format import parse_format
from fewbits.kernels.gpu import (
    GEMV_MAX_ROWS,
    GemvTiles,
    _group_ok,
    choose_gemv_tiles,
    choose_tiles,
    decode_tiles,
    gemv_ok,
)


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


def test_decode_rows_take_the_one_row_kernel_where_codes_read_as_words():
    for m in (1, GEMV_MAX_ROWS):
        assert isinstance(decode_tiles(m, 4096, 4096, 128, False, 2, 264, True), GemvTiles)
    # more rows, or codes that do not read as words: the tile product and its split-K rule
    assert decode_tiles(GEMV_MAX_ROWS + 1, 4096, 4096, 128, False, 2, 264, True) == choose_tiles(
        GEMV_MAX_ROWS + 1, 4096, 4096, 128, False, 264)
    assert decode_tiles(1, 14336, 4096, 4096, True, 2, 264, False) == (16, 64, 128, 5)


def test_one_row_tiles_read_256_bytes_of_a_row_and_keep_the_device_busy():
    # Llama-3-8B's up projection on an H200 (264 programs): 8 columns a program gives 1792 programs
    assert choose_gemv_tiles(14336, 4096, 2, 264) == GemvTiles(8, 512)  # 512 4-bit codes: 256 bytes
    assert choose_gemv_tiles(14336, 4096, 1, 264) == GemvTiles(8, 256)  # 256 8-bit codes
    # SmolLM2's 576 columns: fewer columns a program until >= 528 programs; K = 576 keeps its 512-code blocks
    assert choose_gemv_tiles(576, 576, 2, 264) == GemvTiles(1, 512)
    # a short K: blocks no longer than twice K's
    assert choose_gemv_tiles(4096, 96, 2, 264).bk == 128


def test_codes_read_as_words_only_whole_and_aligned():
    q = torch.zeros(16, 64, dtype=torch.uint8)  # 128 4-bit codes a row: 16 words
    assert gemv_ok(q, 128, 2) and gemv_ok(q, 64, 1)
    assert not gemv_ok(q, 100, 2)  # K not a multiple of 8 codes
    assert not gemv_ok(q, 62, 1)
    assert not gemv_ok(q.t(), 128, 2)  # not contiguous
    assert not gemv_ok(torch.zeros(16 * 64 + 2, dtype=torch.uint8)[2:].view(16, 64), 128, 2)  # off a 4-byte boundary
