"""A hand-written CPU operator for integer weights of <= 4 bits in groups (or per channel) x bf16 activations.

torch's ``aten._weight_int4pack_mm_for_cpu`` reads ~20-27 GB/s of packed weights at one row of activations
on a machine that streams ~2x that, and its cost grows with the rows of x.  This operator is written for
decode (1 to 8 rows) and prefill.  Measured on a busy 2-core Xeon (one thread, CPU time,
`benchmarks/bench_cpu_int4.py --threads 1 --clock cpu`, SmolLM2 and Gemma-3-270M shapes): with the weights
in cache 1.3-1.5x torch's speed at one row; streamed from memory 0.75-1.06x at one row (both then wait on
memory), 1.3-2.5x at 8 rows and 3.5-5x at 128 rows (about a bf16 F.linear's time there).  With a software
prefetch 32 chunks (2 KB) ahead in the one-row loops: 1.07-1.39x torch's at one row, SmolLM2 shapes, 2 threads
(`bench_cpu_int4.py --rows 1 --spec int4-g32 --models smollm2 --min-mb 128 --kernels q4,q4a8,torch`); the
int8-activation path (`Q4A8Kernel`) 1.34-2.24x.

Layout (chosen at load time, the only copy of the weights).  The output rows are cut into blocks of 16; a
block's codes are stored as 64-byte chunks of 16 rows x 8 input columns: 32 little-endian 16-bit words, word
p = 2 i + h of chunk c holding in its nibble j the code of row i, column 8 c + 2 j + h.  Scales are (blocks,
groups, 16) and, for asymmetric codes, the zero offsets likewise (fp16 when every value is exact in fp16,
else fp32).  Blocks concatenate along the rows: fused projections are the parts' tensors concatenated.

Numerics.  With w = s (c - o) (the numeric core's codes: o = 2^(b-1) for symmetric codes, else the zero
point), a group's contribution to y_n is  s * (sum_k (c_k - 2^(b-1)) x_k - (o - 2^(b-1)) * sum_k x_k):  the
centred codes are exact in bf16, the products and sums are fp32, and the zero term uses the per-call group
sums of x (only asymmetric formats).  Activations stay bf16 (no activation quantisation; one row of x, on AVX2
and with AVX512-VNNI, is held in int16, exact to 2^-7 of each 32 columns' largest, see below) and the output is
bf16, the class of numerics of torch's operator.

Fast path (``__AVX512BF16__``): one 512-bit load is a chunk; the word shifted right by 4 j and looked up in a
32-entry table (``vpermw``; the table repeats its 16 entries so the fifth index bit is ignored) gives 16 rows'
bf16 pairs (w_{i,k}, w_{i,k+1}) for ``vdpbf16ps`` against the broadcast pair (x_k, x_{k+1}).  Up to 8 rows of
x reuse each decoded register; more rows are cut into tiles of 8 over the same block (still in L1).  With AMX
(``__AMX_BF16__``, and the kernel's permission, ``at::cpu::init_amx``) from `AMX_MIN_ROWS` (3) rows on and for
groups of multiples of 32 columns, the decoded registers of 4 chunks are stored as one AMX B tile (that is
AMX's pair layout already), x's 32 columns are the A tile, and ``tdpbf16ps`` multiplies up to 16 rows at once:
128 columns are decoded ahead (the codes prefetched) while the tiles multiply the 128 before, each group adds up
in its own C tile (four in turn), stored a group late and scaled as above a group later still, so no tile
instruction waits on the one just before it.  With AVX512-VNNI, below `AMX_MIN_ROWS` rows
where AMX runs and up to 8 rows where it does not (a decode step's few rows; groups of multiples of 32 columns),
x goes as int16 blocks, as the AVX2 path's one row below: nibble j of each word masked in place (the codes times
16^j) meets x's int16 pairs through ``vpdpwssd`` in exact int32 chains, each chain's block sum shifted back by
4 j, converted and scaled once per block of 32 columns per row.  On a 2-core Emerald Rapids Xeon ``vdpbf16ps``
issued at about half ``vpdpwssd``'s rate, and the table lookups competed with it: at one row the int16 path ran
1.2-1.7x the ``vdpbf16ps`` path with the weights in cache (SmolLM2 and Gemma-3 shapes, `bench_cpu_int4.py
--rows 1 --kernels q4 --min-mb 2 --sample-mb 1 --baseline`), the same from memory (both wait on it), and the
compiled SmolLM2 int4-g64 step 1.29x (`benchmarks/bench_x16_step.py`, 10 rounds); at 2-8 rows 1.5-2.3x
``vdpbf16ps`` in cache, and against AMX see `AMX_MIN_ROWS` in the source.

AVX2 path (``__AVX2__`` + FMA + F16C, no AVX-512): two 256-bit loads are a chunk (8 output rows each); a
32-bit lane holds one row's 8 codes, nibble t in bits 4t..4t+3.  Masking nibble t in place and converting
gives code * 16^t exactly, and x's column for that nibble is pre-scaled by 16^-t once per call, so one AND, one
convert and one FMA per 8 weights and row of x, the codes uncentred (a group's sum less (2^(b-1) + zero) *
sum(x over the group)).  Few rows run several FMA chains and both halves of a chunk per broadcast of x; 5-8
rows run as two tiles of 4 over the same block (in L1).  One row of x (a batch-1 decode step), where the group is
a multiple of 32, goes another way: x as int16 per block of 32 columns times a power of two (`act8.int16_blocks`, the
specification; exact for every element within 2^-7 of its block's largest magnitude, the rest rounded to a step of
2^-14 of it), the codes paired per 32-bit lane against x's pairs by ``vpmaddwd``, exact int32 sums scaled once
per block: 36 instructions per 128 weights against the fp32 path's 58.  The compiled SmolLM2 step on an AVX2
EPYC (2 threads, `benchmarks/bench_x16_step.py`): 1.10-1.15x the same step on the fp32 path (at 2-4 rows a
scratch A/B of the operator gained nothing, so more rows keep the fp32 path).  A row holding an Inf or NaN takes
the fp32 path.  Before the int16 path, on an AVX2 host (EPYC, 2 threads, SmolLM2 shapes, `bench_cpu_int4.py
--rows 1,8 --models smollm2 --min-mb 128 --kernels q4,torch`): 1.47-2.46x torch's operator at one row,
1.27-1.69x at eight.  Elsewhere a portable path runs the same layout with plain loops (``path=1``); the dispatcher
does not choose it (torch's operator is faster).

`fewbits_q4::q4_mm` is a torch operator with a fake implementation, so a compiled graph keeps it as one node.
It is compiled once per machine (`fewbits.kernels.native`); where that fails `available()` is False and the
dispatcher falls back to torch's operator.  ``FEWBITS_CPU_INT4=torch`` selects torch's operator instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fewbits.formats.format import Format
from fewbits.formats.packing import pack_bits, unpack_bits
from fewbits.kernels import act8, native
from fewbits.kernels.arena import Bindable
from fewbits.tensor import QuantizedTensor

ROWS = 16  # output rows per block: fused parts need multiples of this
COLS = 8  # input columns per 64-byte chunk: group sizes and in_features need multiples of this

_SRC = Path(__file__).with_name("cpu_int4.cpp").read_text()  # the operators' C++ source, package data

NAME = "fewbits_q4"
_SRC = act8.with_blocks(_SRC)
int16_blocks = act8.int16_blocks  # the one-row int16 path's specification


def _fake_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
             bits: int, path: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0] * ROWS))


def _fake_mm_at(x: torch.Tensor, arena: torch.Tensor, codes_off: int, scales_off: int, zeros_off: int, n: int,
                k: int, group: int, bits: int, half: int, path: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


def _fake_dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, bits: int,
                  portable: int) -> torch.Tensor:
    return codes.new_empty((codes.shape[0] * ROWS, codes.shape[1] * COLS), dtype=torch.bfloat16)


def available(src: str = _SRC, name: str = NAME, cflags: list[str] | None = None) -> bool:
    """Whether `fewbits_q4::q4_mm` is usable (built or loaded once per process; False if no compiler)."""
    return native.build(name, src, {"fewbits_q4::q4_mm": _fake_mm, "fewbits_q4::q4_mm_at": _fake_mm_at,
                                    "fewbits_q4::q4_dequant": _fake_dequant}, cflags=cflags, shims=name == NAME)


def build_variant(name: str, source: str) -> bool:
    """Build `source`, another version of cpu_int4.cpp (a benchmark's baseline: ``git show
    REV:fewbits/kernels/cpu_int4.cpp``), under `torch.ops.<name>`; False where it does not build
    (`native.why(name)` says why)."""
    return native.build(name, act8.with_blocks(source).replace(NAME, name),
                        {f"{name}::q4_mm": _fake_mm, f"{name}::q4_dequant": _fake_dequant})


def fast_path() -> bool:
    """Whether the built operator has a vector path, AVX512-BF16 or AVX2 (else it runs the portable loops)."""
    return available() and bool(torch.ops.fewbits_q4.q4_isa())


AVX2_NAME = "fewbits_q4avx2"


def build_avx2() -> bool:
    """Build the operator without AVX-512 (``-mno-avx512f``: its AVX2 path, where the CPU has AVX2) under
    `torch.ops.fewbits_q4avx2`: tests and benchmarks of that path on a CPU that has AVX-512 (on an AVX2 CPU
    the main build is that path already)."""
    return native.build(AVX2_NAME, _SRC.replace(NAME, AVX2_NAME), {}, cflags=[*native.CFLAGS, "-mno-avx512f"])


def a8_path() -> bool:
    """Whether the built operator has the int8-activation path (AVX512-VNNI, or AVX2's ``vpmaddubsw``)."""
    return available() and bool(int(torch.ops.fewbits_q4.q4_isa()) & 4)


def _offset(qt: QuantizedTensor) -> torch.Tensor:
    z = qt.zero_values()
    if z is None:
        return torch.full((qt.rows, 1), float(2 ** (qt.fmt.bits - 1)))
    return z.float()


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """(N, G) per-row values -> contiguous (N/16, G, 16)."""
    n, g = t.shape
    return t.reshape(n // ROWS, ROWS, g).transpose(1, 2).contiguous()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (N, K) in [0, 16) -> the operator's int16 chunks (N/16, K/8, 32) (module docstring)."""
    n, k = codes.shape
    c = codes.to(torch.int32).reshape(n // ROWS, ROWS, k // COLS, 4, 2).permute(0, 2, 1, 4, 3)  # (NB, C, i, h, j)
    words = (c << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1).reshape(n // ROWS, k // COLS, 2 * ROWS)
    return torch.where(words >= 32768, words - 65536, words).to(torch.int16).contiguous()


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """The operator's int16 chunks (N/16, K/8, 32) -> uint8 codes (N, K): `pack_codes` undone (`row_packing`'s
    bytes unpacked)."""
    return unpack_bits(row_packing(words), 4, words.shape[1] * COLS)


def row_packing(words: torch.Tensor) -> torch.Tensor:
    """The operator's int16 chunks (N/16, K/8, 32) -> uint8 (N, K/2): the codes in the 4-bit row-major packing
    (`fewbits.formats.packing.pack_bits(codes, 4)`: column 2m in byte m's low nibble).

    A chunk's 32-bit lane i (little-endian: word h = 0 in the low half) holds row i's codes of columns 0 2 4 6 in
    its low 16 bits and 1 3 5 7 in its high 16; spreading each half's nibbles to the low nibbles of 4 bytes and
    merging them gives the row's 4 bytes in the 4-bit row-major packing (column 2m in byte m's low nibble), so the
    lanes transposed to rows are that packing: whole-tensor integer operations, ~7x a permute of nibbles."""
    nb, c, _ = words.shape
    lane = words.contiguous().view(torch.int32)  # (NB, C, i)

    def spread(v: torch.Tensor) -> torch.Tensor:  # nibbles 0-3 of v -> the low nibbles of bytes 0-3
        return (v & 0xF) | ((v & 0xF0) << 4) | ((v & 0xF00) << 8) | ((v & 0xF000) << 12)

    packed = spread(lane & 0xFFFF) | (spread((lane >> 16) & 0xFFFF) << 4)
    return packed.transpose(1, 2).contiguous().reshape(-1).view(torch.uint8).reshape(nb * ROWS, c * COLS // 2)


def _exact_half(*ts: torch.Tensor) -> bool:
    return all(bool(torch.equal(t.half().float(), t)) for t in ts)


def group_of(fmt: Format, in_features: int) -> int:
    """Input columns per scale: the format's group size, or in_features per channel/tensor."""
    return fmt.group_size if fmt.granularity == "group" else in_features


#: one empty zero-point tensor per dtype, which every symmetric kernel holds: a compiled decode step takes each
#: distinct tensor it reads as an input, and its C++ wrapper makes (and drops) a handle for every input on every
#: call, so one shared tensor instead of one per linear layer (121 for SmolLM2) spares those (`no_zeros`)
_NO_ZEROS: dict[torch.dtype, torch.Tensor] = {}


def no_zeros(dtype: torch.dtype) -> torch.Tensor:
    """The empty zero-point tensor of `dtype` a symmetric `Q4Kernel` holds (one per process, never written)."""
    return _NO_ZEROS.setdefault(dtype, torch.empty(0, dtype=dtype))


class Q4Kernel(Bindable):
    """2-, 3- and 4-bit integer codes in groups (or per channel) x bf16 activations: `fewbits_q4::q4_mm` (bound to a
    block, `fewbits_q4::q4_mm_at`: `fewbits.kernels.arena`)."""

    name = "cpu_q4"
    # the operator's path: 0 the fastest built, 1 the plain loops, 2 vdpbf16ps without AMX, 4 as 0 but x exact at
    # few rows too (AVX2: the fp32 path, AVX-512: vdpbf16ps; tests, benchmarks), 5 as 0 without AMX (tests)
    path = 0

    @staticmethod
    def layout_reason(fmt: Format, shape: tuple[int, ...]) -> str | None:
        """None when the operator's layout holds `fmt` on a weight of `shape`, else why not."""
        if fmt.kind != "int" or fmt.bits > 4:
            return f"needs integer codes of at most 4 bits, format is {fmt.spec}"
        if len(shape) != 2:
            return f"needs a 2-D weight, shape is {tuple(shape)}"
        n, k = shape
        if n % ROWS or k % COLS:
            return (f"needs out_features divisible by {ROWS} and in_features by {COLS}, weight shape is "
                    f"{tuple(shape)}")
        g = group_of(fmt, k)
        if g % COLS or k % g:
            return f"needs a group size that is a multiple of {COLS} and divides in_features {k}, {fmt.spec} has {g}"
        return None

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if os.environ.get("FEWBITS_CPU_INT4", "").lower() == "torch":
            return "FEWBITS_CPU_INT4=torch selects torch's int4 operator"
        why = Q4Kernel.layout_reason(fmt, shape)
        if why is not None:
            return why
        if not available():
            return f"the operator could not be built ({native.why(NAME)})"
        if not fast_path():
            return ("this CPU has neither AVX512-BF16 nor AVX2: torch's int4 operator is faster than the "
                    "portable loops")
        return None

    def __init__(self, qt: QuantizedTensor) -> None:
        """Repack `qt` (any CPU: without AVX512-BF16 or AVX2 the operator runs its portable loops, which the
        dispatcher does not choose)."""
        why = self.layout_reason(qt.fmt, tuple(qt.shape))
        if why is not None:
            raise ValueError(f"{self.name} cannot run {qt.fmt.spec} {tuple(qt.shape)}: {why}")
        if not available():
            raise RuntimeError(f"{self.name}: the operator could not be built ({native.why(NAME)})")
        rows, cols = qt.shape
        self.group = group_of(qt.fmt, cols)
        self.bits = qt.fmt.bits
        s = qt.scale_values().float()  # (N, n_groups) or (1, 1)
        o = _offset(qt)
        if s.numel() == 1:
            s, o = s.expand(rows, 1), o.expand(rows, 1)
        ng = cols // self.group
        if s.shape[1] != ng:  # a per-tensor offset over per-channel scales and the like
            s, o = s.expand(rows, ng), o.expand(rows, ng)
        z = (o - 2 ** (self.bits - 1)).expand(rows, ng)  # the offset from the centred codes
        symmetric = not bool(z.any())
        half = _exact_half(s) and (symmetric or _exact_half(z))
        dt = torch.float16 if half else torch.float32
        self.codes = pack_codes(qt.unpacked_codes())
        self.scales = _blocked(s).to(dt)
        self.zeros = no_zeros(dt) if symmetric else _blocked(z).to(dt)
        self.shape = qt.shape
        self._op = torch.ops.fewbits_q4.q4_mm.default

    def __deepcopy__(self, memo: dict[int, object]) -> Q4Kernel:
        """A copy with tensors of its own, except that a symmetric kernel's zeros stay the shared empty tensor (a
        copied model's or layer's kernels take one input between them, as the original's do); a copy is not
        bound to its original's block."""
        for t in _NO_ZEROS.values():
            memo.setdefault(id(t), t)
        return super().__deepcopy__(memo)

    def _bind_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.codes, self.scales, self.zeros

    def _bind_args(self, block: torch.Tensor, offsets: tuple[int, ...]) -> tuple:
        n, k = self.shape
        return (block, *offsets, n, k, self.group, self.bits, int(self.scales.dtype == torch.float16))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))

    def unpacked_codes(self) -> torch.Tensor:
        """The codes as the quantised tensor holds them, uint8 (N, K): this kernel is their only copy in a
        `QuantLinear` (`fewbits.models.qlinear`)."""
        return unpack_codes(self.codes)

    def packed_codes(self, bits: int) -> torch.Tensor:
        """`pack_bits(self.unpacked_codes(), bits)`; 4-bit codes straight from the chunks (`row_packing`): a third
        of the time of unpacking and packing them again (a SmolLM2-135M int4-g64 state dict 0.31 -> 0.10 s)."""
        return row_packing(self.codes) if bits == 4 else pack_bits(self.unpacked_codes(), bits)

    def dequantized(self) -> torch.Tensor:
        """The weight as the operator sees it, (N, K) bf16."""
        return torch.ops.fewbits_q4.q4_dequant(self.codes, self.scales, self.zeros, self.group, self.bits,
                                              int(self.path == 1))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"input last dimension {x.shape[-1]} does not match weight shape {tuple(self.shape)}")
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        at = self._bound()
        if at is not None:
            y = torch.ops.fewbits_q4.q4_mm_at(x2, *at, self.path)
        else:
            y = self._op(x2, self.codes, self.scales, self.zeros, self.group, self.bits, self.path)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class Q4A8Kernel(Q4Kernel):
    """`Q4Kernel` with the activations in int8 (llama.cpp's Q4_0 x Q8_0 numerics): each row of x quantised per
    block of 32 columns (`fewbits.kernels.act8`), codes times those int8 values summed exactly in int32 by
    ``vpdpbusd`` (64 products an instruction against ``vdpbf16ps``'s 32, no table lookups), scaled per block and
    group in fp32, at every row count (a prefill rounds as a decode step does; no AMX).  On AVX2 (no VNNI):
    ``vpmaddubsw`` multiplies a chunk half's unsigned codes by 4 broadcast activations, pairs summed in int16; a
    block's 4 chunks add up in int16 without overflow (at most 16 * 15 * 127), then ``vpmaddwd`` by ones gives an
    int32 per output row: 64 exact products per two instructions where the weight-only AVX2 path spends eight
    FMAs, eight converts and eight masks.  The dispatcher offers
    it only in its opt-in "q8" activation mode (`fewbits.kernels.dispatch.prepare_linear_q8`): it adds the
    activations' rounding to the weights'."""

    name = "cpu_q4_a8"
    path = 3

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        why = Q4Kernel.supports(fmt, shape)
        if why is not None:
            return why
        if group_of(fmt, shape[1]) % 32:
            return f"needs groups of a multiple of 32 columns (the activations' blocks), {fmt.spec} has fewer"
        if not a8_path():
            return "this CPU has neither AVX512-VNNI nor AVX2 (the int8-activation path)"
        return None
