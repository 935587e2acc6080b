"""NVIDIA GPU fast paths (import-guarded: this module imports without CUDA or Triton).

* `TritonWeightOnlyKernel` (W8A16 / W4A16 and FP8 weights): one Triton matmul that loads integer or
  E4M3 codes tile by tile and multiplies them, as they are, with bf16 activations on tensor cores; each
  group's scale s and offset m (w = c * s + m, m = -o * s for integer codes with offset o, 0 for FP8)
  are applied to the group's partial sums, s * sum(x c) + m * sum(x), instead of to every weight.
  8-bit codes are stored one per byte, 2..4-bit codes two per byte (low nibble first), so memory
  traffic is the packed size.  Prefill shapes use that tile product (`choose_tiles`); one to
  `GEMV_MAX_ROWS` rows of activations (decode) use `_wq_gemv` instead, where a tile product would
  waste 15 of its 16 rows: the codes read as 32-bit words, turned into floats by bit operations and
  one subtraction, multiplied and reduced in fp32 (`decode_tiles` picks the kernel and its tiles).
* `FP8ScaledMMKernel` (W8A8-FP8): activations quantised per token to E4M3 (scale = amax / 448) and
  multiplied with per-channel E4M3 weights by ``torch._scaled_mm`` (row-wise scales, bf16 output);
  needs compute capability >= 8.9.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from fewbits.formats.format import Format
from fewbits.tensor import QuantizedTensor

try:  # pragma: no cover - exercised only where Triton is installed
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "no Triton"
    triton = None
    tl = None


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (used by the tests)


def cuda_ok() -> bool:
    return torch.cuda.is_available()


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if cuda_ok() else (0, 0)


if triton is not None:  # pragma: no cover

    @triton.jit
    def _wq_matmul(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NG, K_SPLIT,
                   stride_xm, stride_qn, stride_ym,
                   GROUP: tl.constexpr, PACK: tl.constexpr, FP8: tl.constexpr, PER_CHANNEL: tl.constexpr,
                   ATOMIC: tl.constexpr, BF16_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * (c[n, k] * s[n, g] + m[n, g]),  g = k // GROUP.  The codes go into the
        # tile product as they are (integers <= 255 and E4M3 values are exact in bf16); each group's scale and
        # offset are applied once to its partial sums:  s * sum(x c) + m * sum(x).  BLOCK_K divides GROUP, so
        # a K-block lies inside one group; per-channel scales are applied once, after the loop.  Program
        # (pid_m, pid_n, pid_k) covers K_SPLIT columns from pid_k * K_SPLIT and, with split-K, adds its
        # partial result into y atomically.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        k_lo = pid_k * K_SPLIT
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = k_lo + kk
            if PACK == 2:  # two codes a byte, low nibble = even column: even and odd columns as two products
                rh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                ke = 2 * rh
                xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :],
                             mask=mmask[:, None] & (ke[None, :] < K), other=0.0)
                xo = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1,
                             mask=mmask[:, None] & (ke[None, :] + 1 < K), other=0.0)
                b = tl.load(q_ptr + rn[None, :] * stride_qn + rh[:, None],
                            mask=(ke[:, None] < K) & nmask[None, :], other=0)  # (BK/2, BN) bytes
                lo = b & 0xF
                hi = b >> 4
                if BF16_DOT:  # tensor cores; the CPU interpreter (tests) multiplies in fp32 instead
                    part = tl.dot(xe.to(tl.bfloat16), lo.to(tl.bfloat16)) + tl.dot(xo.to(tl.bfloat16),
                                                                                    hi.to(tl.bfloat16))
                else:
                    part = tl.dot(xe.to(tl.float32), lo.to(tl.float32)) + tl.dot(xo.to(tl.float32),
                                                                                  hi.to(tl.float32))
                xs = tl.sum(xe.to(tl.float32), 1) + tl.sum(xo.to(tl.float32), 1)
            else:
                rk = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                             mask=mmask[:, None] & (rk[None, :] < K), other=0.0)
                c = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None],
                            mask=(rk[:, None] < K) & nmask[None, :], other=0)  # (BK, BN)
                if FP8:
                    v = c.to(tl.float8e4nv, bitcast=True)
                else:
                    v = c
                if BF16_DOT:
                    part = tl.dot(xk.to(tl.bfloat16), v.to(tl.bfloat16))
                else:
                    part = tl.dot(xk.to(tl.float32), v.to(tl.float32))
                xs = tl.sum(xk.to(tl.float32), 1)
            if PER_CHANNEL:
                acc += part
                xsum += xs
            else:
                gi = rn * NG + k0 // GROUP
                gmask = nmask & (k0 < K)  # the last split's blocks may lie past K: no group there
                s = tl.load(s_ptr + gi, mask=gmask, other=0.0)
                m = tl.load(m_ptr + gi, mask=gmask, other=0.0)
                acc += part * s[None, :] + xs[:, None] * m[None, :]
        if PER_CHANNEL:
            s = tl.load(s_ptr + rn, mask=nmask, other=0.0)
            m = tl.load(m_ptr + rn, mask=nmask, other=0.0)
            acc = acc * s[None, :] + xsum[:, None] * m[None, :]
        ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=omask)
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=omask)


    @triton.jit
    def _wq_gemv(x_ptr, w_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NG, KW, group,
                 stride_xm, stride_ym,
                 BITS: tl.constexpr, FP8: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GB: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * (c[n, k] * s[n, g] + o[n, g]) for M <= BLOCK_M rows (decode), without a tile
        # product.  The codes are read as 32-bit words of CPW = 32 // BITS codes each, the first code in the
        # lowest bits: the stored layout (one byte a code, or two a byte, low nibble first), KW words a row.  An
        # integer code c becomes a float without a conversion instruction: the word (c | 0x4B000000) is the
        # float 2^23 + c, exactly, so one subtraction gives c.  A K-block of BLOCK_K columns is BLOCK_K // GB
        # sub-blocks of GB columns (unrolled, so that their loads are in flight together), each inside one group
        # (GB divides the group size; per-channel formats pass group = K): its sums take the group's scale and
        # offset, s * sum(x c) + o * sum(x).  The codes of a sub-block are a (BLOCK_N, words, CPW) tensor and x
        # is read in the same (words, CPW) shape, so nothing is reshaped.  Program pid covers BLOCK_N output
        # columns and all of K; the weights are read once for all M rows.
        CPW: tl.constexpr = 32 // BITS
        WG: tl.constexpr = GB // CPW
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rw = tl.arange(0, WG)
        ri = tl.arange(0, CPW)
        rows = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // GB):
                kj = k0 + j * GB
                wk = kj // CPW + rw
                w = tl.load(w_ptr + rn[:, None] * KW + wk[None, :], mask=nmask[:, None] & (wk < KW)[None, :],
                            other=0)
                c = (w[:, :, None] >> (ri * BITS)[None, None, :]) & ((1 << BITS) - 1)  # column kj + CPW * word + i
                if FP8:
                    v = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    v = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                gmask = nmask & (kj < K)  # a sub-block past K: no group there
                s = tl.load(s_ptr + rn * NG + kj // group, mask=gmask, other=0.0)
                o = tl.load(m_ptr + rn * NG + kj // group, mask=gmask, other=0.0)
                xk = kj + rw[:, None] * CPW + ri[None, :]
                for mi in tl.static_range(BLOCK_M):
                    x = tl.load(x_ptr + mi * stride_xm + xk, mask=(xk < K) & (mi < M), other=0.0).to(tl.float32)
                    part = tl.sum(tl.sum(v * x[None, :, :], axis=2), axis=1)
                    r = part * s + tl.sum(tl.sum(x, axis=1), axis=0) * o
                    acc += tl.where(rows[:, None] == mi, r[None, :], 0.0)
        ptrs = y_ptr + rows[:, None] * stride_ym + rn[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & nmask[None, :])


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


#: weights of at least this many elements split K on decode shapes; smaller ones run unsplit, since a split
#: adds two launches (zeroing the fp32 output, casting it) that cost the host more than they save the device
SPLIT_MIN_ELEMENTS = 2**22


def choose_tiles(m: int, n: int, k: int, group: int, per_channel: bool, programs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k) for an (m, k) x (k, n) product on a device that runs `programs`
    programs at once (2 per multiprocessor).

    Decode (m <= 16): 64-column tiles and 128-long K-blocks (or the largest power of two dividing the group),
    and, for weights of >= SPLIT_MIN_ELEMENTS, split-K until about 4 x `programs` programs are in flight,
    at most 8 splits.  Measured on an H200 (benchmarks/tune_gemv.py, one row, CUDA-graph passes over 256 MB):
    int8 14336 x 4096 33.6 us with 64 x 128 / split 4 against 55.8 us with 32 x 128 unsplit, 4096 x 14336
    34.0 us with split 8; int4-g128 53.5 / 55.2 us with split 8.  Larger m: square 64-tiles, no split."""
    if m <= 16:
        bm, bn, bk = 16, 64, 128
    else:
        bm, bn, bk = 64, 64, 64
    if not per_channel:
        bk = _pow2_divisor(group, bk)
    kb = -(-k // bk)
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    if m <= 16 and n * k >= SPLIT_MIN_ELEMENTS and tiles < 4 * programs:
        split = max(1, min(kb, 8, -(-4 * programs // tiles)))
    return bm, bn, bk, split


#: decode batches of up to this many rows run `_wq_gemv` (its rows are unrolled in the kernel), more the tile product
GEMV_MAX_ROWS = 8


class GemvTiles(NamedTuple):
    """`_wq_gemv`'s tiles: BLOCK_N output columns a program, BLOCK_K columns of K a loop step, its warps."""

    bn: int
    bk: int
    warps: int = 4


Tiles = tuple[int, int, int, int] | GemvTiles  # (BLOCK_M, BLOCK_N, BLOCK_K, split_k) of `_wq_matmul`, or `_wq_gemv`'s


def gemv_ok(q: torch.Tensor, k: int, pack: int) -> bool:
    """Whether `_wq_gemv` can read the codes q (N rows of K codes, `pack` a byte) as 32-bit words: whole words
    a row, from a 4-byte boundary."""
    per_word = 8 if pack == 2 else 4
    return q.dtype == torch.uint8 and k % per_word == 0 and q.is_contiguous() and q.storage_offset() % 4 == 0


def choose_gemv_tiles(n: int, k: int, pack: int, programs: int) -> GemvTiles:
    """`_wq_gemv`'s tiles for an (m <= GEMV_MAX_ROWS, k) x (k, n) product: K-blocks of 256 bytes of a row's codes
    (512 codes two a byte, 256 one a byte; halved while twice K still fits), 8 output columns a program with 4
    warps (32 codes a thread held as floats across the rows), halved while fewer than 2 x `programs` programs
    would run.  A first choice, not yet swept on a device: `benchmarks/tune_gemv.py --gemv` does that."""
    bk = 512 if pack == 2 else 256
    while bk > 32 and bk >= 2 * k:
        bk //= 2
    bn = 8
    while bn > 1 and -(-n // bn) < 2 * programs:
        bn //= 2
    return GemvTiles(bn, bk)


def decode_tiles(m: int, n: int, k: int, group: int, per_channel: bool, pack: int, programs: int,
                 words: bool) -> Tiles:
    """The kernel and tiles for an (m, k) x (k, n) product: `_wq_gemv` for m <= GEMV_MAX_ROWS where the codes
    read as words (`gemv_ok`), else `_wq_matmul`'s `choose_tiles`."""
    if m <= GEMV_MAX_ROWS and words:
        return choose_gemv_tiles(n, k, pack, programs)
    return choose_tiles(m, n, k, group, per_channel, programs)


class TritonWeightOnlyKernel:
    """Integer (2..8-bit) or FP8-E4M3 weights with bf16 activations: one Triton matmul reads the codes
    (8-bit one a byte, 2..4-bit two a byte, so memory traffic is the packed size), multiplies them with
    the activations on tensor cores and applies each group's scale and offset to the partial sums."""

    name = "cuda_triton_weight_only"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if triton is None:
            return "Triton is not installed"
        if not cuda_ok():
            return "no CUDA device"
        if len(shape) != 2:
            return f"needs a 2-D weight, shape is {tuple(shape)}"
        if fmt.kind == "fp8" and fmt.element == "e4m3":
            if _capability() < (8, 9):
                return "FP8 needs compute capability >= 8.9"
        elif fmt.kind != "int":
            return f"handles integer and fp8-e4m3 codes, format is {fmt.spec}"
        return _group_ok(fmt)

    def __init__(self, qt: QuantizedTensor, device: str | torch.device = "cuda") -> None:
        rows, cols = qt.shape
        why = _group_ok(qt.fmt)
        if why is not None:
            raise ValueError(f"{qt.fmt.spec}: {why}")
        codes = qt.unpacked_codes()  # (N, K) uint8 (8-bit codes: the stored tensor itself)
        self.fp8 = qt.fmt.kind == "fp8"
        self.pack = 2 if qt.fmt.kind == "int" and qt.fmt.bits <= 4 else 1
        if self.pack == 2 and qt.fmt.bits == 4 and cols % 2 == 0:
            codes = qt.codes  # stored as this kernel reads them (low nibble = even column): held once, not copied
        elif self.pack == 2:
            c = torch.nn.functional.pad(codes, (0, cols % 2))
            codes = c[:, 0::2] | (c[:, 1::2] << 4)  # (N, ceil(K/2)), low nibble = even column
        s = qt.scale_values().float()
        if s.numel() == 1:
            s = s.expand(rows, 1)
        if self.fp8:
            m = torch.zeros_like(s)
        else:
            z = qt.zero_values()
            o = z if z is not None else torch.full_like(s, float(2 ** (qt.fmt.bits - 1)))
            m = -o.expand_as(s) * s
        self.q = codes.contiguous().to(device)
        self.s = s.contiguous().to(device)  # (N, NG)
        self.m = m.contiguous().to(device)
        self.ng = s.shape[1]
        self.group = cols // self.ng
        self.shape = qt.shape
        dev = torch.device(device)
        # programs in flight: 2 per multiprocessor; the interpreter (CPU) gets a small number, so that its
        # tests take the split-K path too
        self.programs = 2 * torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self._tiles: dict[int, Tiles] = {}  # rows -> decode_tiles(...)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.s.numel() + self.m.numel()) * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles | None = None) -> torch.Tensor:
        """y = x @ W.T (+ bias) in x's dtype; `tiles` (a `GemvTiles`, or (BLOCK_M, BLOCK_N, BLOCK_K, split_k) for
        the tile product) overrides `decode_tiles` (benchmarks/tune_gemv.py sweeps it)."""
        N, K = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)
        if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
            x2 = x2.to(torch.bfloat16).contiguous()
        M = x2.shape[0]
        if torch.compiler.is_compiling() and tiles is None:  # one opaque node of the compiled graph
            from fewbits.kernels import ops

            y = ops.triton_wq_mm(x2, self.q, self.s, self.m, N, self.group, self.pack, self.fp8, self.programs)
        else:
            if tiles is None:
                tiles = self._tiles.get(M)
                if tiles is None:
                    tiles = self._tiles[M] = decode_tiles(M, N, K, self.group, self.ng == 1, self.pack, self.programs,
                                                          gemv_ok(self.q, K, self.pack))
            y = _launch(x2, self.q, self.s, self.m, N, self.group, self.pack, self.fp8, tiles, x.dtype)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*lead, N)


def _launch(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, N: int, group: int, pack: int,
            fp8: bool, tiles: Tiles, out_dtype: torch.dtype) -> torch.Tensor:
    """One launch of `_wq_gemv` (`GemvTiles`) or `_wq_matmul`: y (M, N) = x2 (M, K) bf16 times the codes q with
    scales s and offsets m."""
    M, K = x2.shape
    ng = s.shape[1]
    if isinstance(tiles, GemvTiles):
        if M > GEMV_MAX_ROWS or not gemv_ok(q, K, pack):
            raise ValueError(f"the one-row kernel takes <= {GEMV_MAX_ROWS} rows of codes that read as aligned words "
                             f"(K a multiple of {8 if pack == 2 else 4}); got {M} rows, K = {K}")
        y = torch.empty((M, N), device=x2.device, dtype=out_dtype)
        w = q.view(torch.int32)
        gb = tiles.bk if ng == 1 else _pow2_divisor(group, tiles.bk)  # a sub-block inside one group
        _wq_gemv[(triton.cdiv(N, tiles.bn),)](x2, w, s, m, y, M, N, K, ng, w.shape[1], group,
                                              x2.stride(0), y.stride(0), BITS=4 if pack == 2 else 8, FP8=fp8,
                                              BLOCK_M=1 << (M - 1).bit_length(), BLOCK_N=tiles.bn, BLOCK_K=tiles.bk,
                                              GB=gb, num_warps=tiles.warps)
        return y
    bm, bn, bk, split = tiles
    kb = -(-K // bk)
    k_split = -(-kb // split) * bk
    split = -(-K // k_split)
    if split > 1:
        y = torch.zeros((M, N), device=x2.device, dtype=torch.float32)
    else:
        y = torch.empty((M, N), device=x2.device, dtype=out_dtype)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _wq_matmul[grid](x2, q, s, m, y, M, N, K, ng, k_split,
                     x2.stride(0), q.stride(0), y.stride(0),
                     GROUP=group, PACK=pack, FP8=fp8, PER_CHANNEL=ng == 1,
                     ATOMIC=split > 1, BF16_DOT=not _INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


_TILES: dict[tuple[int, int, int, int, bool, int, int, bool], Tiles] = {}


def launch_weight_only(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, n_out: int, group: int,
                       pack: int, fp8: bool, programs: int) -> torch.Tensor:
    """`TritonWeightOnlyKernel`'s matmul from its tensors alone (the registered operator's body): bf16 (M, n_out)."""
    M, K = x2.shape
    key = (M, n_out, K, group, s.shape[1] == 1, pack, programs, gemv_ok(q, K, pack))
    tiles = _TILES.get(key)
    if tiles is None:
        tiles = _TILES[key] = decode_tiles(*key)
    y = _launch(x2, q, s, m, n_out, group, pack, fp8, tiles, torch.bfloat16)
    return y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)


def _group_ok(fmt: Format) -> str | None:
    """None if the kernel takes `fmt`'s groups: a K-block must lie inside one group, and a K-block is at
    least 16 codes (tile products need 16), or 32 for codes packed two a byte."""
    if fmt.granularity != "group":
        return None
    need = 32 if fmt.kind == "int" and fmt.bits <= 4 else 16
    if fmt.group_size % need:
        return f"group size {fmt.group_size} is not a multiple of {need}"
    return None


class FP8ScaledMMKernel:
    """W8A8-FP8: per-channel E4M3 weights x per-token E4M3 activations via torch._scaled_mm."""

    name = "cuda_fp8_scaled_mm"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if not cuda_ok():
            return "no CUDA device"
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return "torch has no _scaled_mm / float8_e4m3fn"
        if _capability() < (8, 9):
            return "FP8 needs compute capability >= 8.9"
        if fmt.kind != "fp8" or fmt.element != "e4m3" or fmt.granularity == "group":
            return f"needs per-channel or per-tensor fp8-e4m3 weights, format is {fmt.spec}"
        if len(shape) != 2 or shape[0] % 16 or shape[1] % 16:
            return f"needs both dimensions divisible by 16, weight shape is {tuple(shape)}"
        return None

    def __init__(self, qt: QuantizedTensor, device: str | torch.device = "cuda") -> None:
        rows, _ = qt.shape
        w8 = qt.unpacked_codes().view(torch.float8_e4m3fn)  # (N, K) E4M3 bit patterns
        self.wT = w8.to(device).t()  # (K, N) column-major, as _scaled_mm wants
        s = qt.scale_values().float().reshape(-1)
        self.sw = (s.expand(rows) if s.numel() == 1 else s).reshape(1, rows).contiguous().to(device)
        self.shape = qt.shape

    @property
    def nbytes(self) -> int:
        return self.wT.numel() + self.sw.numel() * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N, K = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K).float()
        M = x2.shape[0]
        pad = (-M) % 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        sx = (x2.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)  # (M, 1)
        xq = (x2 / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.wT, scale_a=sx, scale_b=self.sw, out_dtype=torch.bfloat16)[:M]
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*lead, N)
