"""Projections that read the same input run as one matmul in the decode step: q/k/v, and the MLP's gate/up.

A decode step of SmolLM2-135M made 211 matmul calls (7 a layer and the LM head), each a kernel launch of a
few microseconds on a vector of one token; fusing q/k/v and gate/up makes it 4 a layer (121 a step).

One rule decides.  The parts of a group fuse when they are the same kind of layer with the same kernel
class, input width and dtype, and that kernel's tensors concatenate along the output rows:

* 16-bit `nn.Linear`: weights (N, K) and biases (missing ones as zeros) concatenated;
* `Int8PackKernel` (``aten._weight_int8pack_mm``) and `Int8RowsKernel` (the same tensors, a few-row
  operator for decode sizes): int8 codes (N, K), scales (N,) and the asymmetric
  formats' rank-1 correction (N,) (zeros for a part without one: adding 0 changes no value);
* `Q4Kernel` (fewbits' own <= 4-bit operator, `fewbits.kernels.cpu_int4`): its codes, scales and zero offsets
  are laid out in blocks of `cpu_int4.ROWS` output rows along their first dimension, so the parts concatenate
  along it (every part has whole blocks: the kernel takes only such shapes) when they share group and code
  width; scales stored in different float widths are widened to fp32 (exact), a symmetric part's missing
  zero offsets become zeros.  The parts then read row slices of the fused tensors (views, no copy);
* `Int4PackKernel` (``aten._weight_int4pack_mm_for_cpu``): the packed codes (N, K/2) and the (K/g, N, 2)
  scale table, with the same group.  The operator packs rows in blocks (64 rows with AVX-512), so parts
  concatenate only when each has a multiple of `INT4_ROW_BLOCK` rows; the fused matmul is then checked once
  against the parts on a random row (bitwise: each output is the same dot product);
* `Fp8RowsKernel` (FP8 codes with one scale per channel or per tensor): codes (N, K) and scales concatenated,
  a per-tensor part's scale repeated for its rows, when the parts share the element (E4M3 or E5M2).

Anything else (grouped fp8, W8A8, the reference path, formats that differ between the parts under a mixed recipe)
stays unfused, with the reason in `Fused.skipped`.

Memory: the fused tensors become the storage and the original layers see row views of them (the 16-bit
weights and biases, the int8 codes/scales/corrections, the int4 packed codes), so the model's own forward
still works and the weights are held once (a second decoder over the model reuses them).  A part's columns
of the int4 (K/g, N, 2) scale table are not contiguous, and the operator reads a strided table wrongly, so
an int4 part (`Int4PackRows`) copies its columns (K/g x N_part x 4 bytes, ~20 KB) on each of its own calls
rather than keep a second table (7% of the int4-g64 weights' bytes); the decode step never calls the
parts.  Moving the model (`model.to`) rebuilds its quantised kernels apart from these tensors: build the
decoder again after moving it.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fewbits.kernels.cpu import Int4PackKernel, Int8PackKernel
from fewbits.kernels.cpu_int4 import ROWS as Q4_ROW_BLOCK
from fewbits.kernels.cpu_int4 import Q4Kernel, no_zeros
from fewbits.kernels.cpu_rows import Fp8RowsKernel, Int8RowsA8Kernel, Int8RowsKernel

#: int8 kernel classes over the same tensors (q, scales, corr)
INT8_KERNELS = (Int8PackKernel, Int8RowsKernel, Int8RowsA8Kernel)
INT4_ROW_BLOCK = 64  # rows the CPU int4 packing keeps together (AVX-512: 64, AVX2: 32)


class FusedLinear:
    """One matmul for several projections of the same input: `fused(x)` -> the parts' outputs (views)."""

    def __init__(self, kind: str, sizes: tuple[int, ...], weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, kernel: object | None = None) -> None:
        self.kind, self.sizes = kind, sizes
        self.weight, self.bias, self.kernel = weight, bias, kernel
        for t in (weight, bias):  # a CUDA graph copies its inputs on every replay unless told they stay put
            if t is not None and t.is_cuda:
                torch._dynamo.mark_static_address(t)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.kernel is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self.kernel(x, self.bias)
        return tuple(y.split(self.sizes, dim=-1))


class Int4PackRows(Int4PackKernel):
    """One part of a fused int4 group, as a kernel of its own (the model's own forward calls it): its rows of
    the fused packed codes (a view) and its columns of the fused scale table, made contiguous per call."""

    def __init__(self, part: Int4PackKernel, whole: Int4PackKernel, rows: tuple[int, int]) -> None:
        self.__dict__.update({k: v for k, v in vars(part).items() if k not in ("packed", "scales_zeros")})
        self.packed = whole.packed[rows[0]:rows[1]]
        self._table, self._rows = whole.scales_zeros, rows

    @property
    def scales_zeros(self) -> torch.Tensor:  # read by Int4PackKernel.__call__
        return self._table[:, self._rows[0]:self._rows[1]].contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self._table.shape[0] * (self._rows[1] - self._rows[0]) * 4


@dataclass
class LayerFusion:
    qkv: FusedLinear | None
    gate_up: FusedLinear | None


@dataclass
class Fused:
    """The fused projections of every decoder layer, with why any group stayed apart."""

    layers: list[LayerFusion]
    skipped: list[str] = field(default_factory=list)

    @property
    def matmuls_saved(self) -> int:
        return sum((2 if f.qkv else 0) + (1 if f.gate_up else 0) for f in self.layers)


def _why_not(mods: list[nn.Module]) -> str | None:
    """None when `mods` fuse by the rule above, else why not."""
    kinds = {type(m) for m in mods}
    if len(kinds) != 1:
        return f"layer types differ ({', '.join(sorted(k.__name__ for k in kinds))})"
    m0 = mods[0]
    if {getattr(m, "in_features", None) for m in mods} != {m0.in_features}:
        return "input widths differ"
    if type(m0) is nn.Linear:
        w = [m.weight for m in mods]
        if len({(t.dtype, t.device) for t in w}) != 1 or w[0].dtype not in (torch.bfloat16, torch.float16,
                                                                                 torch.float32):
            return "weight dtypes or devices differ"
        return None
    kernel = getattr(m0, "kernel", None)
    if type(kernel) not in (*INT8_KERNELS, Int4PackKernel, Fp8RowsKernel) and not isinstance(kernel, Q4Kernel):
        return f"kernel {getattr(kernel, 'name', type(kernel).__name__)} is not one that fuses"
    if len({type(m.kernel) for m in mods}) != 1:
        return "kernels differ (" + ", ".join(sorted({m.kernel.name for m in mods})) + ")"
    if type(kernel) is Fp8RowsKernel and len({m.kernel.element for m in mods}) != 1:
        return "fp8 elements differ"
    if type(kernel) is Int4PackKernel:
        if len({m.kernel.group for m in mods}) != 1:
            return "int4 groups differ"
        if any(m.kernel.shape[0] % INT4_ROW_BLOCK for m in mods):
            return f"an int4 part's rows are not a multiple of {INT4_ROW_BLOCK} (the operator's packing block)"
    if isinstance(kernel, Q4Kernel):  # its int8-activation subclass too (the path travels with the copy)
        if len({m.kernel.group for m in mods}) != 1:
            return "int4 groups differ"
        if len({m.kernel.bits for m in mods}) != 1:
            return "code widths differ"
        if any(m.kernel.shape[0] % Q4_ROW_BLOCK for m in mods):
            return f"a part's rows are not a multiple of {Q4_ROW_BLOCK} (the operator's row block)"
    return None


def _cat_bias(mods: list[nn.Module], like: torch.Tensor) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    dtype = next(m.bias.dtype for m in mods if m.bias is not None)
    return torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=dtype,
                                                                             device=like.device) for m in mods])


def _bounds(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in sizes:
        out.append((a, a + n))
        a += n
    return out


def _give_views(mods: list[nn.Module], sizes: tuple[int, ...], bias: torch.Tensor | None) -> None:
    """Each part's bias becomes its rows of the fused bias (a missing one stays missing)."""
    for m, (a, b) in zip(mods, _bounds(sizes), strict=True):
        if m.bias is not None:
            m.bias.data = bias[a:b]


def _fuse_dense(mods: list[nn.Module], sizes: tuple[int, ...]) -> FusedLinear:
    weight = torch.cat([m.weight.detach() for m in mods])
    bias = _cat_bias(mods, weight)
    for m, (a, b) in zip(mods, _bounds(sizes), strict=True):
        m.weight.data = weight[a:b]
    _give_views(mods, sizes, bias)
    return FusedLinear("dense", sizes, weight, bias)


def _fuse_int8(mods: list[nn.Module], sizes: tuple[int, ...]) -> FusedLinear:
    ks = [m.kernel for m in mods]
    k = copy.copy(ks[0])
    k.q = torch.cat([p.q for p in ks])
    k.scales = torch.cat([p.scales for p in ks])
    k.corr = None
    if any(p.corr is not None for p in ks):
        k.corr = torch.cat([p.corr if p.corr is not None else torch.zeros(p.shape[0]) for p in ks])
    k.shape = (sum(sizes), ks[0].shape[1])
    for p, (a, b) in zip(ks, _bounds(sizes), strict=True):
        p.q, p.scales = k.q[a:b], k.scales[a:b]
        if p.corr is not None:
            p.corr = k.corr[a:b]
    bias = _cat_bias(mods, k.q)
    _give_views(mods, sizes, bias)
    return FusedLinear("int8", sizes, bias=bias, kernel=k)


def _fuse_fp8(mods: list[nn.Module], sizes: tuple[int, ...]) -> FusedLinear:
    ks = [m.kernel for m in mods]
    k = copy.copy(ks[0])
    k.w8 = torch.cat([p.w8 for p in ks])
    k.channel_scales = torch.cat([p.channel_scales.expand(p.shape[0]) for p in ks])  # per tensor: repeated
    k.scales = torch.cat([p.scales.expand(p.shape[0], 1) for p in ks])  # (N, 1): the many-row path's
    k.shape = (sum(sizes), ks[0].shape[1])
    for p, (a, b) in zip(ks, _bounds(sizes), strict=True):
        p.w8, p.channel_scales, p.scales = k.w8[a:b], k.channel_scales[a:b], k.scales[a:b]
    bias = _cat_bias(mods, k.w8)
    _give_views(mods, sizes, bias)
    return FusedLinear("fp8", sizes, bias=bias, kernel=k)


def _fuse_int4(mods: list[nn.Module], sizes: tuple[int, ...]) -> tuple[FusedLinear | None, str | None]:
    ks = [m.kernel for m in mods]
    k = copy.copy(ks[0])
    k.packed = torch.cat([p.packed for p in ks])
    k.scales_zeros = torch.cat([p.scales_zeros for p in ks], dim=1).contiguous()
    k.shape = (sum(sizes), ks[0].shape[1])
    x = torch.randn(1, k.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        if not torch.equal(k(x), torch.cat([p(x) for p in ks], -1)):
            return None, "the int4 operator's packing does not concatenate by rows on this machine"
    for m, rows in zip(mods, _bounds(sizes), strict=True):
        m.kernel = Int4PackRows(m.kernel, k, rows)
    bias = _cat_bias(mods, k.packed)
    _give_views(mods, sizes, bias)
    return FusedLinear("int4", sizes, bias=bias, kernel=k), None


def _fuse_q4(mods: list[nn.Module], sizes: tuple[int, ...]) -> FusedLinear:
    ks = [m.kernel for m in mods]
    k = copy.copy(ks[0])
    dt = ks[0].scales.dtype if len({p.scales.dtype for p in ks}) == 1 else torch.float32
    k.codes = torch.cat([p.codes for p in ks])
    k.scales = torch.cat([p.scales.to(dt) for p in ks])
    if all(p.zeros.numel() == 0 for p in ks):
        k.zeros = no_zeros(dt)
    else:
        k.zeros = torch.cat([p.zeros.to(dt) if p.zeros.numel() else torch.zeros_like(p.scales, dtype=dt) for p in ks])
    k.shape = (sum(sizes), ks[0].shape[1])
    for p, (a, b) in zip(ks, _bounds(sizes), strict=True):
        lo, hi = a // Q4_ROW_BLOCK, b // Q4_ROW_BLOCK
        p.codes, p.scales = k.codes[lo:hi], k.scales[lo:hi]
        p.zeros = k.zeros[lo:hi] if k.zeros.numel() else k.zeros
    bias = _cat_bias(mods, k.codes)
    _give_views(mods, sizes, bias)
    return FusedLinear("q4", sizes, bias=bias, kernel=k)


#: first part -> its group's fused projection, so that decoders over one model share one fused copy
_DONE: weakref.WeakKeyDictionary[nn.Module, FusedLinear] = weakref.WeakKeyDictionary()


def _part_tensor(m: nn.Module, kind: str) -> torch.Tensor:
    return {"dense": lambda: m.weight, "int8": lambda: m.kernel.q, "int4": lambda: m.kernel.packed,
            "q4": lambda: m.kernel.codes, "fp8": lambda: m.kernel.w8}[kind]()


def _still_views(f: FusedLinear, mods: list[nn.Module]) -> bool:
    """Whether every part still reads its rows of `f` (not so once a part's kernel was rebuilt)."""
    whole = {"dense": lambda: f.weight, "int8": lambda: f.kernel.q, "int4": lambda: f.kernel.packed,
             "q4": lambda: f.kernel.codes, "fp8": lambda: f.kernel.w8}[f.kind]()
    per = Q4_ROW_BLOCK if f.kind == "q4" else 1  # the q4 codes' first dimension counts blocks of rows
    try:
        return len(mods) == len(f.sizes) and all(
            _part_tensor(m, f.kind).data_ptr() == whole[a // per:b // per].data_ptr()
            for m, (a, b) in zip(mods, _bounds(f.sizes), strict=True))
    except AttributeError:
        return False


def fuse_group(mods: list[nn.Module]) -> tuple[FusedLinear | None, str | None]:
    """(the fused projection, None) or (None, why the parts stay apart).  On success the parts read views of
    the fused tensors (see the module docstring); a group fused before is returned as it is."""
    done = _DONE.get(mods[0])
    if done is not None and _still_views(done, mods):
        return done, None
    f, why = _fuse(mods)
    if f is not None:
        _DONE[mods[0]] = f
    return f, why


def _fuse(mods: list[nn.Module]) -> tuple[FusedLinear | None, str | None]:
    why = _why_not(mods)
    if why is not None:
        return None, why
    sizes = tuple(int(m.out_features) for m in mods)
    if type(mods[0]) is nn.Linear:
        return _fuse_dense(mods, sizes), None
    if type(mods[0].kernel) in INT8_KERNELS:
        return _fuse_int8(mods, sizes), None
    if isinstance(mods[0].kernel, Q4Kernel):
        return _fuse_q4(mods, sizes), None
    if type(mods[0].kernel) is Fp8RowsKernel:
        return _fuse_fp8(mods, sizes), None
    return _fuse_int4(mods, sizes)


def fuse_projections(model: nn.Module, n_layers: int) -> Fused:
    """Fuse q/k/v and gate/up of the first `n_layers` decoder layers of a transformers causal LM (a model
    fused before, by another decoder over it, keeps its fused tensors)."""
    layers, skipped = [], []
    for i, layer in enumerate(model.model.layers[:n_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, why = fuse_group([attn.q_proj, attn.k_proj, attn.v_proj])
        if why:
            skipped.append(f"layer {i} q/k/v: {why}")
        gate_up = None
        if all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            gate_up, why = fuse_group([mlp.gate_proj, mlp.up_proj])
        else:
            why = f"{type(mlp).__name__} is not a gated MLP"
        if why:
            skipped.append(f"layer {i} gate/up: {why}")
        layers.append(LayerFusion(qkv, gate_up))
    return Fused(layers, skipped)
