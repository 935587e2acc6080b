import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fewbits.formats.packing import pack_bits, pack_int32, packed_len, unpack_bits, unpack_int32


def test_golden_int4_word():
    # codes 1, 2, 3, 4 first-code-lowest in one int32 word
    w = pack_int32(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4)
    assert w.tolist() == [0x00004321]


def test_golden_bytes():
    assert pack_bits(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4).tolist() == [0x21, 0x43]
    assert pack_bits(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).tolist() == [0b10_01_00_11]
    # 3-bit codes 1..7, 0: sum of code_i << 3i = 0x1F58D1, i.e. bytes D1 58 1F
    # byte 0 = [low 2 bits of code 2 = 11][code 1 = 010][code 0 = 001]
    b = pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8), 3)
    assert b.tolist() == [0b11_010_001, 0x58, 0x1F]
    # eight full 4-bit codes make one word with the sign bit set
    w = pack_int32(torch.tensor([0xF] * 8, dtype=torch.uint8), 4)
    assert w.tolist() == [-1]
    # GPTQ 3-bit: code 10 straddles words 0 and 1
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[10] = 0b111
    assert pack_int32(codes, 3).tolist() == [-(2**31) + 2**30, 1, 0]


def test_rows_are_packed_independently():
    c = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8)
    p = pack_bits(c, 4)
    assert p.shape == (2, 2)
    assert p.tolist() == [[0x21, 0x03], [0x54, 0x06]]


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_round_trip_every_width(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g).to(torch.uint8)
    p = pack_bits(codes, bits)
    assert p.shape == (rows, packed_len(n, bits))
    assert torch.equal(unpack_bits(p, bits, n), codes)
    assert torch.equal(unpack_int32(pack_int32(codes, bits), bits, n), codes)


def test_errors():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 8)
