"""NVIDIA GPU fast paths (import-guarded: this module imports without CUDA or Triton).

* `TritonWeightOnlyKernel` (W8A16 / W4A16 and FP8 weights): one Triton GEMM that loads integer or
  E4M3 codes tile by tile, dequantises them in registers as  w = c * s + m  (m = -o * s for integer
  codes with offset o, 0 for FP8) per group, and multiplies with bf16 activations on tensor cores.
  8-bit codes are stored one per byte, 2..4-bit codes two per byte (low nibble first), so memory
  traffic is the packed size.
* `FP8ScaledMMKernel` (W8A8-FP8): activations quantised per token to E4M3 (scale = amax / 448) and
  multiplied with per-channel E4M3 weights by ``torch._scaled_mm`` (row-wise scales, bf16 output);
  needs compute capability >= 8.9.
"""

from __future__ import annotations

import os

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
    def _wq_gemm(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, NG,
                 stride_xm, stride_qn, stride_ym,
                 GROUP: tl.constexpr, PACK: tl.constexpr, FP8: tl.constexpr, BF16_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # (BM, BK)
            wmask = (rk[:, None] < K) & (rn[None, :] < N)
            if PACK == 2:
                b = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None] // 2, mask=wmask, other=0)
                c = (b >> ((rk[:, None] % 2) * 4).to(tl.uint8)) & 0xF  # (BK, BN)
            else:
                c = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=wmask, other=0)
            if FP8:
                v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                v = c.to(tl.float32)
            gi = rn[None, :] * NG + rk[:, None] // GROUP
            s = tl.load(s_ptr + gi, mask=wmask, other=0.0)
            m = tl.load(m_ptr + gi, mask=wmask, other=0.0)
            w = v * s + m
            if BF16_DOT:  # tensor cores; the CPU interpreter (tests) multiplies in fp32 instead
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:
                acc += tl.dot(x.to(tl.float32), w)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


class TritonWeightOnlyKernel:
    """Integer (2..8-bit) or FP8-E4M3 weights with bf16 activations, dequantised inside a Triton GEMM."""

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
            return None if _capability() >= (8, 9) else "FP8 needs compute capability >= 8.9"
        if fmt.kind != "int":
            return f"handles integer and fp8-e4m3 codes, format is {fmt.spec}"
        return None

    def __init__(self, qt: QuantizedTensor, device: str | torch.device = "cuda") -> None:
        rows, cols = qt.shape
        codes = qt.unpacked_codes()  # (N, K) uint8
        self.fp8 = qt.fmt.kind == "fp8"
        self.pack = 2 if qt.fmt.kind == "int" and qt.fmt.bits <= 4 else 1
        if self.pack == 2:
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

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.s.numel() + self.m.numel()) * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N, K = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
        M = x2.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=torch.float32)
        bm = 16 if M <= 16 else 64
        bn, bk = 64, 64
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _wq_gemm[grid](x2, self.q, self.s, self.m, y, M, N, K, self.ng,
                       x2.stride(0), self.q.stride(0), y.stride(0),
                       GROUP=self.group, PACK=self.pack, FP8=self.fp8, BF16_DOT=not _INTERPRET,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*lead, N)


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
