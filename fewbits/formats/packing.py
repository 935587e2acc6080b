"""Bit packing: codes of 2..8 bits into a little-endian bit stream, first code in the lowest bits.

Code i of a row occupies bits [i*b, (i+1)*b) of the row's stream.  Read as bytes, byte k holds bits
[8k, 8k+8); read as int32 words (little-endian), word k holds bits [32k, 32k+32).  This is the layout
GPTQ-style checkpoints use for their `qweight`/`qzeros` int32 words (4-bit: 8 codes per word, code 0 in
bits 0..3; 3-bit: a continuous stream across words).
"""

from __future__ import annotations

import torch


def packed_len(n: int, bits: int) -> int:
    """Bytes needed for `n` codes of `bits` bits."""
    return -(-n * bits // 8)


def _check(codes: torch.Tensor, bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"packing takes 1..8 bits per code, got {bits}")
    if codes.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (..., n) of `bits` bits into bytes (..., ceil(n*bits/8)) uint8.

    Codes must already lie in [0, 2**bits); higher bits are masked off.
    """
    _check(codes, bits)
    *lead, n = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    per = 8 // bits if 8 % bits == 0 else 0
    if per:  # 1, 2, 4 bits: several whole codes per byte
        pad = (-n) % per
        c = codes.to(torch.uint8) & ((1 << bits) - 1)
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*lead, -1, per)  # (..., bytes, codes per byte)
        out = c[..., 0].clone()
        for j in range(1, per):
            out |= c[..., j] << (bits * j)
        return out
    # 3, 5, 6, 7 bits: 8 codes fill exactly `bits` bytes; assemble them in one 64-bit word
    pad = (-n) % 8
    c = codes.to(torch.int64) & ((1 << bits) - 1)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*lead, -1, 8)  # (..., chunks, 8 codes)
    shifts = torch.arange(8, dtype=torch.int64, device=c.device) * bits
    word = (c << shifts).sum(-1)  # (..., chunks): 8*bits <= 56 bits used
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=c.device) * 8
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)  # (..., chunks, bits)
    return out.reshape(*lead, -1)[..., : packed_len(n, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (..., ceil(n*bits/8)) uint8 -> (..., n) uint8 codes."""
    _check(packed, bits)
    *lead, nbytes = packed.shape
    if nbytes != packed_len(n, bits):
        raise ValueError(f"{nbytes} packed bytes cannot hold exactly {n} codes of {bits} bits")
    p = packed.to(torch.uint8)
    if bits == 8:
        return p.contiguous()
    mask = (1 << bits) - 1
    per = 8 // bits if 8 % bits == 0 else 0
    if per:
        shifts = torch.arange(per, dtype=torch.uint8, device=p.device) * bits
        c = (p.unsqueeze(-1) >> shifts) & mask  # (..., bytes, codes per byte)
        return c.reshape(*lead, -1)[..., :n].contiguous()
    pad = (-nbytes) % bits
    q = p.to(torch.int64)
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.reshape(*lead, -1, bits)  # (..., chunks, bytes per chunk)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=p.device) * 8
    word = (q << byte_shifts).sum(-1)  # (..., chunks)
    shifts = torch.arange(8, dtype=torch.int64, device=p.device) * bits
    c = ((word.unsqueeze(-1) >> shifts) & mask).to(torch.uint8)  # (..., chunks, 8)
    return c.reshape(*lead, -1)[..., :n].contiguous()


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (..., n) into int32 words (..., ceil(n*bits/32)), least significant bits first."""
    b = pack_bits(codes, bits)
    pad = (-b.shape[-1]) % 4
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    w = b.reshape(*b.shape[:-1], -1, 4).to(torch.int64)  # (..., words, 4 bytes little-endian)
    word = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as signed int32
    return word.to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_int32`."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(4, dtype=torch.int64, device=w.device) * 8
    b = ((w.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(*w.shape[:-1], -1)
    return unpack_bits(b[..., : packed_len(n, bits)], bits, n)
