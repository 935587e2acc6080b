"""Decode attention over a 16-bit, int8, fp8 or KIVI (4/2-bit) KV cache, and the step's write into a quantised one,
as hand-written CPU operators.

Inductor turns the folded reductions of `LayerKV.scores` / `weighted_values` into loops that unpack 4- and
2-bit codes with index arithmetic inside the reduction, one query head at a time; at 2048 tokens that was
~27x slower than the 16-bit cache.  This kernel reads each row of codes once for all the query heads that
share its KV head (GQA), unpacks it into a small float row, and runs plain dot products and axpys on it,
with the scales and minima folded out of the loops exactly as in `LayerKV`.  Tokens are cut into chunks
(whole KIVI groups) that run in parallel with a per-chunk softmax (maximum, sum, weighted values) merged at
the end, so one KV head still uses every thread; the 16-bit residual window is one more chunk, read by
`attend_rows`' vector loops.  The KIVI codes meet 16-bit integers instead of floats (in 256-bit vectors, on AVX2
and AVX-512 CPUs alike, wherever a value group spans whole 8-byte blocks of codes): the query times a key group's
scales and the softmax weights times the value scales are rounded to int16 (steps of 2^-15 of their largest, finer
than bf16), and `vpmaddwd` multiplies two codes by two of them and adds the pair exactly, where fp32 needs a
shift, a mask, a conversion and an FMA per code; the loops are unrolled for the exact number of query heads of a
pass and the plane reorderings are shuffles.  One layer at 2048 tokens (SmolLM2's heads), one thread: 244 -> 133
us (the 16-bit cache: 127 us); two threads 80 us (76 us).  On an AVX-512 EPYC the same integer path took 61-77 us
where the 512-bit fp32 one took 92-106 (two threads, side by side).

`fewbits_kv::attend_rows` is the same over a cache of whole rows, 16-bit or int8 with per-token scales and no
window (chunks of `CHUNK_ROWS` tokens, rows widened in registers, four query heads per pass): it reads slots up
to the query's own only, where inductor's fused reductions read every slot of the preallocated cache and split
the work by head (three KV heads on two threads).  On an int8 cache it took 133 -> ~100 us a layer at 2048 tokens
(its scales per token folded into the scores and the weights, as in `attend_kv`).  An int8 cache now meets 16-bit
integers instead (head dim a multiple of 16): the query and the softmax weights times the value scales are rounded
to int16 as KIVI's, and units are cut to 512 tokens so the int32 sums stay exact.  With AVX-512 VNNI (head dim a
multiple of 32) `vpdpwssd` multiplies 32 codes by 32 of them and adds them in pairs into int32 lanes, and the lanes
of 16 tokens' scores are summed together (a transpose by shuffles) instead of one token at a time; elsewhere the
256-bit `vpmaddwd` path of KIVI's codes takes them as one plane of sign-extended bytes.  One layer at 2048 tokens,
an AVX-512 EPYC, two threads, side by side with the 16-bit cache: 31.5 us against 50.9 (before: ~55 against ~53);
the build without AVX-512 on the same CPU: 43.3 against 52.0 (before: 55.8 against 54.6).  KIVI's scores and
values take the same 512-bit instruction where a row of codes is 16 (scores) or a multiple of 32 bytes.  The
16-bit cache's fp32 scores sum 16 rows' lanes together the same way (`scores_16`): 66.4 -> 57.5 us a layer there.
KIVI's per-group work (the query times each key group's scales, rounded to int16; the softmax weights times the
value scales, rounded) runs in 512-bit vectors with the rounding inline on AVX-512 CPUs: one layer at 2048 tokens,
an AVX-512 Xeon with AMX, 2 threads, side by side: 1.04-1.09x (batch 1), 1.09-1.12x (batch 8).  Tried there and not
kept: the scores through AMX's integer tiles (16 tokens' unpacked codes times the query split into high and low
bytes, bit for bit the VNNI sums): 0.70x with the tiles fed group by group, 0.81-0.85x with a unit's codes unpacked
first; with three query heads a tile product fills 12 of its 64 bytes of columns.

An fp8 (E4M3) cache without a window is read the same way: each code widened as the bits of an fp16 (its seven
exponent and mantissa bits shifted into an fp16's read as the value / 2^8; the per-token scales times 2^8),
exactly; inductor's fused reductions over torch's float8 conversion had made it ~35x slower per byte than the
16-bit cache (`fewbits probe`: 2.1 s per GB of cache against 55-60 ms).  Its writes stay tensor operations.

`fewbits_kv::append_kv` is a decode step's write into such a cache (`LayerKV.step`): the token into the 16-bit
window and, at the step that completes a group leaving the window, that group quantised into its codes,
scales and minima with `fewbits.kvcache.quant`'s arithmetic (IEEE fp32, round half to even, fp16 scales; the
file is built without ``-ffast-math`` for it), bit for bit.  Its schema marks the cache tensors it writes
(``Tensor(a!)``), so a compiled step keeps it as one node that writes in place, and the quantisation runs only
when a group is full, not under a `torch.where` at every step.

Both are torch operators with fake implementations, so a compiled step keeps each as one node.  Their source is
kvkernel.cpp (the shared helpers and the operators) with its per-ISA parts written in where it names them
(`source`): kvkernel_avx512.inc (the 512-bit fp32 loops), kvkernel_avx2.inc (the 256-bit ones),
kvkernel_i16.inc (the 16-bit integer loops over KIVI's codes, and the int8 cache's as one 8-bit plane) and
kvkernel_vnni.inc (their 512-bit VNNI kernels); one translation unit, as before.  They are compiled once per
machine (`fewbits.kernels.native`) with the C++ compiler the compiled path already needs and cached under
``$FEWBITS_CACHE/kernels`` (default ``~/.cache/fewbits``); where that fails `available()` is False and
`fewbits.decode.cache` / `fewbits.decode.step` keep the pure-torch write and reductions.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fewbits.kernels import native

#: a line of kvkernel.cpp that stands for one of its per-ISA parts (kvkernel_avx512.inc, _avx2, _i16, _vnni)
PART = re.compile(r'^#include "(kvkernel_\w+\.inc)"\n', re.M)


def source() -> str:
    """The operators' C++ source (package data): kvkernel.cpp with each per-ISA part it names (`PART`) written in
    where it stands, one translation unit as the build compiles it."""
    here = Path(__file__).parent
    return PART.sub(lambda m: (here / m.group(1)).read_text(), (here / "kvkernel.cpp").read_text())


_SRC = source()

CHUNK = 256  # tokens per parallel unit
#: the fewest tokens per parallel unit of `attend_rows` (a row is cheap to read: small units keep both threads busy
#: from a few hundred tokens on, with one to four KV heads; longer contexts get longer units, ~8 per thread)
CHUNK_ROWS = 64
NAME = "fewbits_attend_kv"


#: built without -ffast-math: `append_kv` must round as `fewbits.kvcache.quant` does (a division stays a
#: division); the attention's sums vectorise through `omp simd` instead
CFLAGS = native.EXACT_CFLAGS


def available() -> bool:
    """Whether the `fewbits_kv` operators are usable (built or loaded once per process; False if no compiler)."""
    return native.build(NAME, _SRC, {"fewbits_kv::attend_kv": _fake, "fewbits_kv::attend_rows": _fake,
                                     "fewbits_kv::append_kv": _fake_append}, CFLAGS, shims=True)


AVX2_NAME = "fewbits_attend_kv_avx2"


def build_avx2() -> bool:
    """The operators built without AVX-512 (``-mno-avx512f``: `attend_rows`' 256-bit path, where the CPU has
    AVX2) under `torch.ops.fewbits_kv_avx2`: tests of that path on a CPU that has AVX-512."""
    return native.build(AVX2_NAME, _SRC.replace("TORCH_LIBRARY(fewbits_kv,", "TORCH_LIBRARY(fewbits_kv_avx2,"), {},
                        [*CFLAGS, "-mno-avx512f"])


def _fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


def _fake_append(*args: object) -> None:
    return None
