"""llama.cpp's block types as fewbits formats: the block table (pure Python, so the cost model can read it).

A GGML block type stores `block` weights as `bits`-bit unsigned codes plus a header of `header_bytes`
(fp16 scales, packed sub-block scales and mins).  Every type decodes as

    w = s * (c - offset) + m        per sub-block of `sub` weights

with s and m read from the header exactly as llama.cpp's (and gguf-py's) dequantisers compute them:

======  =====  =====  ===  ======  ====================================================================
spec    bits   block  sub  header  s, m
======  =====  =====  ===  ======  ====================================================================
q4_0    4      32     32   2       s = d (fp16), codes - 8
q4_1    4      32     32   4       s = d, m = min (both fp16)
q5_0    5      32     32   2       s = d, codes - 16
q5_1    5      32     32   4       s = d, m = min
q8_0    8      32     32   2       s = d, codes - 128
q4_k    4      256    32   16      s = d * sc, m = -(dmin * mn); sc, mn 6-bit, packed in 12 bytes
q5_k    5      256    32   16      as q4_k
q6_k    6      256    16   18      s = d * sc, sc int8 (16 bytes), codes - 32
======  =====  =====  ===  ======  ====================================================================

(ggml-common.h's block structs; "K-quants" are the 256-weight super-blocks with sub-block scales.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    """One llama.cpp block type: its code width, block and sub-block sizes, header bytes and code offset."""

    name: str  # fewbits spec, lower case
    gguf_name: str  # gguf.GGMLQuantizationType member
    bits: int
    block: int
    sub: int
    header_bytes: int
    offset: int  # code of the value 0 for symmetric types, 0 for types with a min
    has_min: bool

    @property
    def bits_per_weight(self) -> float:
        return self.bits + 8 * self.header_bytes / self.block

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in a GGUF file: header + codes."""
        return self.header_bytes + self.block * self.bits // 8


#: spec -> type; the order is the order `fewbits formats` lists them in
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("q4_0", "Q4_0", 4, 32, 32, 2, 8, False),
    GGMLType("q4_1", "Q4_1", 4, 32, 32, 4, 0, True),
    GGMLType("q5_0", "Q5_0", 5, 32, 32, 2, 16, False),
    GGMLType("q5_1", "Q5_1", 5, 32, 32, 4, 0, True),
    GGMLType("q8_0", "Q8_0", 8, 32, 32, 2, 128, False),
    GGMLType("q4_k", "Q4_K", 4, 256, 32, 16, 0, True),
    GGMLType("q5_k", "Q5_K", 5, 256, 32, 16, 0, True),
    GGMLType("q6_k", "Q6_K", 6, 256, 16, 18, 32, False),
)}
