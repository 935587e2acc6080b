"""Matmuls of a few rows of activations (a decode step: 1 to 8 tokens) by 16-bit or int8 weights on a CPU.

At one to eight rows a matmul is a read of the weight: its speed is the bytes of the weight over the
memory bandwidth.  torch's bf16 matmul read ~15-20 GB/s at one row here, its int8 operator (W8A16) less;
these operators aim at the bandwidth instead:

* `fewbits_rows::dense_mm(x, w)`: x (M, K) and w (N, K) both bf16 or both fp16 -> x @ w.T (M, N).  The
  weight is read where it is (row-major, any row stride: the tied embedding of an LM head, or row views of a
  fused projection), never repacked.  bf16 weights go through ``_mm512_dpbf16_ps`` (bf16 pairs multiplied
  exactly, summed in fp32); fp16 weights are widened (``_mm512_cvtph_ps``) and multiplied in fp32.
* `fewbits_rows::int8_mm(x, q, scales, corr)`: x (M, K) any float dtype, q (N, K) int8, scales (N,) ->
  (x @ q.T) * scales [+ sum_k(x) * corr], the layout of `fewbits.kernels.cpu.Int8PackKernel` (codes shifted
  to int8, one scale per output channel, `corr` the asymmetric formats' rank-1 correction or None).  The
  codes are widened to fp32 and multiplied in fp32; at one row of x on the AVX2 and AVX-512 builds (in_features a
  multiple of 32) x is taken as int16 blocks instead (`fewbits.kernels.act8.int16_blocks`: exact for every bf16
  element within 2^-7 of its block's largest, the rest to 2^-14 of it) and the codes meet it through ``vpmaddwd``
  in exact int32 sums, one convert and FMA per 32 weights: 1.13-1.51x the fp32 path on an AVX-512 EPYC, SmolLM2's
  and Gemma-3's shapes (``path=1`` keeps x in fp32; `benchmarks/bench_rows.py --int8-fp32`).  With AVX512-BF16,
  2-8 rows of a bf16 x multiply the codes converted to bf16 (exact) by ``dpbf16`` instead of fp32 FMAs: 5 + M
  instructions per 32 weights against 4 + 2 M; on that EPYC at 4 and 8 rows 1.02-1.36x the fp32 pass (SmolLM2's
  fused q/k/v, gate/up, down and head; 2 rows 0.96-1.18x), `bench_rows.py --rows 2,4,8 --ops int8 --baseline`.
  The M x R sums a block of channels ends with are folded to four lanes and added four at a time (``sums``): 8 rows
  1.50-1.89x (int8) and 1.14-1.38x (bf16) over reducing each alone.  On a CPU with AMX (`rows_amx()`), 2-16 rows
  of a bf16 x go through its integer tiles instead: each row of x a 24-bit fixed point (`act8.fixed24_rows`: every
  bf16 element within 2^-15 of its row's largest exact, the rest to 2^-22 of it) in three byte planes, the codes
  read straight into the tiles, ``tdpbssd`` / ``tdpbsud`` summing exactly, one rounding to fp32 (a row holding an
  Inf or NaN takes the dpbf16 path).  On a 2-core AMX Xeon 1.07-1.15x the bf16-tile path it replaced (the codes
  converted to bf16 for ``tdpbf16ps``), itself 1.26-2.39x the dpbf16 path at 2-8 rows.
* `fewbits_rows::fp8_mm(x, codes, scales, e5m2)`: x (M, K) any float dtype, codes (N, K) uint8 FP8 codes (E4M3,
  or E5M2), scales (N,) or (1,) -> (x @ w.T) * scales, the layout of `fewbits.kernels.cpu.Fp8DequantKernel` with
  one scale per channel or tensor.  Each code is widened to fp32 as an fp16 (E5M2 is an fp16's top byte, E4M3's
  bits shifted into an fp16's, its value / 2^8), exactly, then multiplied in fp32: one byte a weight read.

Every loaded weight vector is used for all M rows, several output channels are read at once (independent
accumulators), and the output channels are split between threads (``at::parallel_for``).  One row of x reads one
weight row at a time instead, a single sequential stream: several rows side by side are as many interleaved
streams, which the hardware prefetchers of both an AVX2 and an AVX-512 EPYC followed at about half the memory's
speed (on the AVX-512 one, 8 channels a pass against one: SmolLM2's and Gemma-3's bf16 layers and heads 1.27-1.78x
faster one at a time, `benchmarks/bench_rows.py --rows 1 --baseline`).  Sums are fp32;
the result is rounded once to x's dtype.  Three builds of one source, by the CPU (`built_isa`): AVX-512 (the
above), AVX2 + FMA (8 columns a step, every weight dtype widened to fp32 and multiplied with x in fp32 by
FMAs; ``int8_mm_a8`` through ``vpmaddubsw``; one row of x reads one weight row at a time, a single sequential
stream, where several rows side by side ran at about half the memory's speed: SmolLM2's int8 head from memory
at 14.9 GB/s on an AVX2 EPYC, 2 threads, against 8.9; 7 or 8 rows whose fp32 copy outgrows L1 run as two
groups of 4 rows by 2 channels, 1.26-1.53x the 8-by-1 pass on 1536-8192 columns), and plain loops the compiler
vectorises (no AVX2, or the source compiled with ``FEWBITS_ROWS_PORTABLE``).

The operators are built once per machine through `fewbits.kernels.native` (`available()`); where that
fails callers keep torch's operators.  ``FEWBITS_CPU_ROWS=torch`` turns them off (`enabled()`), for
before/after measurements.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fewbits.kernels import act8, native

SRC = Path(__file__).with_name("rows.cpp").read_text()  # the operators' C++ source, package data

SRC = act8.with_blocks(SRC)
NAME = "fewbits_rows"
MAX_ROWS = 8  # rows of x up to which int8_mm beats torch's int8 operator (benchmarks/bench_rows.py)


def built_isa() -> int:
    """The vector path the operators are compiled with on this CPU (``-march=native``): 2 AVX-512 (F, BW, VL),
    1 AVX2 + FMA + F16C, 0 the plain loops; read from the CPU's flags, so it is known without building (the
    built library's ``rows_isa()`` says the same)."""
    flags = set(native.cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return 2
    return 1 if {"avx2", "fma", "f16c"} <= flags else 0


def amx_cpu() -> bool:
    """Whether this CPU has AMX's bf16 tiles (read from its flags, as `built_isa`)."""
    return {"amx_tile", "amx_bf16"} <= set(native.cpu_flags().split())


#: weight dtype -> rows of x up to which dense_mm beats torch's matmul (benchmarks/bench_rows.py): on an AVX-512
#: EPYC oneDNN's bf16 matmul is faster from 3 rows; on an AVX-512 Xeon with AMX it was not (dense_mm 2.0-2.6x
#: torch's at 3-4 rows, 1.19-1.32x at 8: SmolLM2's q/k/v, gate/up, down and head); without AVX-512 oneDNN widens
#: bf16 slowly (2-3 GB/s at 8 rows against dense_mm's 8-10 on an AVX2 host)
DENSE_MAX_ROWS = {torch.bfloat16: 2 if built_isa() == 2 and not amx_cpu() else 8, torch.float16: 8}
#: rows of a bf16 x up to which int8_mm beats torch's int8 operator: where its AMX path runs (`rows_amx`), 16
#: (2.7-4.0x torch's at 12 and 16 rows on a 2-core AMX Xeon, SmolLM2's q/k/v, gate/up, down and head); else MAX_ROWS
INT8_BF16_MAX_ROWS = 16 if built_isa() == 2 and amx_cpu() and {"avx512_bf16", "amx_int8"} <= set(
    native.cpu_flags().split()) else MAX_ROWS


def _fake_dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _fake_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, corr: torch.Tensor | None,
               path: int = 0) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


def _fake_int8_at(x: torch.Tensor, arena: torch.Tensor, q_off: int, scales_off: int, corr_off: int, n: int,
                  path: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


def _fake_fp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, e5m2: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))


def _fake_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def fakes(ns: str = NAME) -> dict:
    """The fake implementations of the operators under namespace `ns`."""
    return {f"{ns}::dense_mm": _fake_dense, f"{ns}::int8_mm": _fake_int8, f"{ns}::int8_mm_at": _fake_int8_at,
            f"{ns}::int8_mm_a8": _fake_int8, f"{ns}::fp8_mm": _fake_fp8, f"{ns}::argmax_rows": _fake_argmax}


ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, the same indices (the first maximum; a NaN counts as the maximum), through
    `argmax_rows` for (batch, vocabulary) CPU logits when the operators are loaded in this process already (it
    never starts a build: the compiled CPU decode loads them): torch's CPU reduction takes ~0.2 ms for one
    49152-token bf16 row and ~0.9 ms for eight, 2-6% of a small model's decode step."""
    if (logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype in ARGMAX_DTYPES
            and logits.shape[1] > 0 and logits.stride(1) == 1 and native.loaded(NAME)):
        return torch.ops.fewbits_rows.argmax_rows(logits)
    return logits.argmax(-1)


def available() -> bool:
    """Whether `torch.ops.fewbits_rows` is usable (built or loaded once per process; False if no compiler)."""
    return native.build(NAME, SRC, fakes(), shims=True)


def enabled() -> bool:
    """Whether callers should use these operators: built, and not turned off by ``FEWBITS_CPU_ROWS=torch``."""
    return os.environ.get("FEWBITS_CPU_ROWS", "") != "torch" and available()


def why_not() -> str | None:
    """None when `enabled()`, else why not."""
    if os.environ.get("FEWBITS_CPU_ROWS", "") == "torch":
        return "FEWBITS_CPU_ROWS=torch"
    return None if available() else f"the operators did not build ({native.why(NAME)})"


PORTABLE_NS = "fewbits_rows_portable"


def build_portable() -> bool:
    """Build the plain-C++ path (no AVX-512 intrinsics, compiled with ``-mno-avx512f`` as for an AVX2 CPU) under
    `torch.ops.fewbits_rows_portable`: tests and benchmarks of the path other CPUs run."""
    return build_variant(PORTABLE_NS, ("FEWBITS_ROWS_PORTABLE",), ("-mno-avx512f",))


AVX2_NS = "fewbits_rows_avx2"


def build_avx2() -> bool:
    """Build the AVX2 + FMA path (compiled with ``-mno-avx512f``, as for an AVX2 CPU) under
    `torch.ops.fewbits_rows_avx2`: tests and benchmarks of that path on a CPU that has AVX-512."""
    return build_variant(AVX2_NS, (), ("-mno-avx512f",))


def build_variant(ns: str, defines: tuple[str, ...] = (), cflags: tuple[str, ...] = (),
                  source: str | None = None) -> bool:
    """Build the same source under operator namespace `ns` with extra macros / compiler flags (tests and
    benchmarks of the portable path: ``defines=("FEWBITS_ROWS_PORTABLE",)``, ``cflags=("-mno-avx512f",)``), or
    `source`, another version of ``rows.cpp`` (a benchmark's baseline: ``git show REV:fewbits/kernels/rows.cpp``)."""
    text = SRC if source is None else act8.with_blocks(source)
    src = "".join(f"#define {d}\n" for d in (f"ROWS_NS {ns}", *defines)) + text
    defined = {k: v for k, v in fakes(ns).items() if f'm.def("{k.split("::")[1]}(' in text}  # an older source's
    return native.build(ns, src, defined, native.CFLAGS + list(cflags))
