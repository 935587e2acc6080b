"""The quantised matmuls as registered torch operators, so that `torch.compile` keeps each one as a single
opaque node of the graph (no graph break, no tracing into numba or Triton launch code).

Each operator has a *fake* implementation (output shape and dtype only) that the compiler traces with.  The
kernels in `cpu.py` / `gpu.py` call these operators only while being compiled
(`torch.compiler.is_compiling()`); eager calls go straight to the underlying aten op or launch, which
skips the dispatcher's extra Python hop (~10 us a call, ~2 ms over a SmolLM2 decode step).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fewbits::int4pack_mm", mutates_args=())
def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """(M, K) bf16 x int4-packed (N, K) weight -> (M, N) bf16: ``aten._weight_int4pack_mm_for_cpu``."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu.default(x, packed, group, scales_zeros)


@int4pack_mm.register_fake
def _int4pack_mm_fake(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], scales_zeros.shape[1]))


@torch.library.custom_op("fewbits::int8pack_mm", mutates_args=())
def int8pack_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(M, K) bf16 x int8 (N, K) weight with per-row bf16 scales -> (M, N): ``aten._weight_int8pack_mm``."""
    return torch.ops.aten._weight_int8pack_mm.default(x, q, scales)


@int8pack_mm.register_fake
def _int8pack_mm_fake(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], q.shape[0]))


@torch.library.custom_op("fewbits::fp8_dequant_mm", mutates_args=())
def fp8_dequant_mm(x: torch.Tensor, w8: torch.Tensor, lut: torch.Tensor, scales: torch.Tensor,
                   group: int) -> torch.Tensor:
    """(M, K) bf16 x FP8 codes (N, K) uint8: the codes decoded through `lut` (256 float32 values) and scaled
    per (row, group of `group` columns) into a bf16 weight, then a bf16 matmul."""
    from fewbits.kernels.cpu import fp8_weight

    w = fp8_weight(w8, lut.numpy(), scales, group)
    return torch.nn.functional.linear(x, w)


@fp8_dequant_mm.register_fake
def _fp8_dequant_mm_fake(x: torch.Tensor, w8: torch.Tensor, lut: torch.Tensor, scales: torch.Tensor,
                         group: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], w8.shape[0]))


@torch.library.custom_op("fewbits::triton_wq_mm", mutates_args=())
def triton_wq_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, n_out: int, group: int,
                 pack: int, fp8: bool, programs: int) -> torch.Tensor:
    """(M, K) bf16 x integer / FP8 codes on a GPU through fewbits' Triton weight-only matmul -> (M, n_out) bf16."""
    from fewbits.kernels.gpu import launch_weight_only

    return launch_weight_only(x, q, s, m, n_out, group, pack, fp8, programs)


@triton_wq_mm.register_fake
def _triton_wq_mm_fake(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, n_out: int, group: int,
                       pack: int, fp8: bool, programs: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n_out))


_LOWERED = False


def lower_cpu_ops_to_aten() -> None:
    """Let inductor compile `int4pack_mm` / `int8pack_mm` as the aten operators they wrap (inductor's own
    lowerings, called from the generated code directly), not through the operators' Python bodies (a
    dispatcher hop into Python per call, ~200 calls a SmolLM2 step).  Dynamo still sees one fewbits node per
    matmul (`torch._dynamo.explain` shows them); this only tells inductor what that node is.  Idempotent;
    imports inductor, so it is called when a step is first compiled, not when fewbits is imported."""
    global _LOWERED
    if _LOWERED:
        return
    from torch._inductor.decomposition import register_decomposition

    @register_decomposition(torch.ops.fewbits.int4pack_mm.default)
    def _int4(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu.default(x, packed, group, scales_zeros)

    @register_decomposition(torch.ops.fewbits.int8pack_mm.default)
    def _int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm.default(x, q, scales)

    _LOWERED = True
