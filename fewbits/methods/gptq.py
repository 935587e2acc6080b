"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers").

Quantise the columns of W one at a time; after rounding column q, spread its error over the columns not
yet quantised so that the layer output on the calibration inputs X moves as little as possible
(Optimal Brain Surgeon update with H = 2 X X^T):

    delta_F = -(w_q - quant(w_q)) / [H_F^-1]_qq * (H_F^-1)_{:,q}           (paper eq. 2)

Algorithm 1 of the paper: the rows of the upper Cholesky factor U of H^-1 (H^-1 = U^T U) give every
[H_F^-1] needed; updates are applied lazily, one block of B columns at a time (eq. 4).

Deviations and additions:
* Damping lambda = damp * mean(diag H) (default 1 %); when the Cholesky factorisation fails, damping is
  multiplied by 10 and retried, with a log line; after `max_tries` the layer falls back to
  round-to-nearest (logged, never a crash, never NaN).
* Dead input columns (zero Hessian diagonal, never excited by the data) keep their weights and are
  rounded to nearest (the reference code zeroes them, which loses them for inputs calibration missed).
* Groups: with `static_groups` (forced by act-order) group scales come from the original W, so codes
  keep their column order and no index permutation has to be stored; otherwise each group's scale is
  taken from the already-updated weights when quantisation reaches the group (block size is rounded up
  to a multiple of the group size so a group lies inside one lazy block and is fully up to date).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, compute_scales
from fewbits.methods import workspace
from fewbits.methods.common import MethodError, QuantResult, check_method_format, column_format, naming
from fewbits.methods.config import GPTQ
from fewbits.methods.gptq_loop import (
    gathered_transpose,
    permuted_transpose,
    quantize_block_columns,
    symmetric_permute,
)
from fewbits.methods.linalg import inverse_upper_factor
from fewbits.methods.rtn import rtn_quantize

log = logging.getLogger("fewbits.gptq")


def inverse_hessian_factor(
    hessian: torch.Tensor, damp: float = 0.01, max_tries: int = 6, name: str = "layer"
) -> tuple[torch.Tensor, float] | None:
    """Upper Cholesky factor U of (H + lambda I)^-1 with lambda = damp * mean(diag H), and the damp used.

    Damping is raised tenfold after every failed factorisation (logged); None after `max_tries`.
    """
    H = hessian.float()
    mean_diag = torch.diag(H).mean().clamp_min(1e-12)
    ratio = damp
    for _ in range(max_tries):
        # one factorisation H = R R^T (R upper) and one triangular inverse U = R^-1 (fewbits.methods.linalg)
        # instead of factorise, invert, factorise again; the same bits on any thread count
        U, info = inverse_upper_factor(H, ratio * mean_diag)
        ok = info == 0 and all_finite(U) and bool((U.diagonal() > 0).all())
        if ok:
            return U, ratio
        workspace.release(U)
        nxt = ratio * 10 if ratio > 0 else 1e-3
        log.warning("%s: Hessian is not positive definite with damping %.3g of its mean diagonal; "
                    "retrying with %.3g", name, ratio, nxt)
        ratio = nxt
    return None


def _int_range(fmt: Format) -> tuple[int, int, int]:
    """(lowest, highest) rounded value and the offset that turns it into a stored code: -2^(b-1)..2^(b-1)-1
    on the full symmetric grid, -L..L on the narrow one, 0..2^b-1 with a zero point."""
    return fmt.qmin, fmt.qmax, 2 ** (fmt.bits - 1) if fmt.symmetric else 0


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    fmt: Format | str,
    *,
    block_size: int = GPTQ.block_size,  # the defaults of the method's one config (`methods/config.py`)
    damp: float = GPTQ.damp,
    act_order: bool = GPTQ.act_order,
    static_groups: bool = GPTQ.static_groups,
    max_tries: int = 6,
    name: str = "weight",
) -> QuantResult:
    """GPTQ codes for a weight (rows, cols) given the Hessian (cols, cols) of its inputs (X^T X up to scale).

    Returns codes, scales and zero points in the layout of `fewbits.formats.quant`; `info` holds the
    damping used, the OBS loss sum (w - q)^2 / [H^-1]_qq and whether the layer fell back to RTN.
    """
    fmt = check_method_format("gptq", fmt)
    if w.dim() != 2:
        raise MethodError(f"{name}: GPTQ expects a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    fmt.check_shape((rows, cols), name)
    if tuple(hessian.shape) != (cols, cols):
        raise MethodError(f"{name}: Hessian shape {tuple(hessian.shape)} does not match {cols} input columns")
    if not all_finite(hessian):
        raise MethodError(f"{name}: Hessian contains NaN or inf (were the calibration activations finite?)")
    W = w.detach().float()  # never written: the loop works on a transposed copy
    if not all_finite(W):
        raise MethodError(f"{name}: weight of shape {(rows, cols)} contains NaN or inf")
    H = hessian.detach().float()  # copied before any change below
    dead = torch.diag(H) <= 0
    if bool(dead.all()):
        log.warning("%s: calibration never reached this layer (Hessian is zero); using round-to-nearest", name)
        res = rtn_quantize(W, fmt, name)
        res.info.update(method="gptq", fallback="rtn: no calibration data")
        return res
    if dead.any():
        H = H.clone()
        H[dead, :] = 0
        H[:, dead] = 0
        H[dead, dead] = torch.diag(H)[~dead].mean()

    grouped = fmt.granularity == "group"
    g = fmt.group_size if grouped else cols
    static = (not grouped) or static_groups or act_order
    scale = zero = None
    if static:
        with naming(name):
            scale, zero = compute_scales(W, fmt)  # (rows, n_groups) from the original weights
        if fmt.granularity == "tensor":  # broadcast the single scale to every row
            scale = scale.expand(rows, 1).contiguous()
            zero = zero.expand(rows, 1).contiguous() if zero is not None else None
    else:
        scale = torch.zeros(rows, cols // g)
        zero = torch.zeros(rows, cols // g) if not fmt.symmetric else None

    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else None
    if perm is not None:
        Hp = workspace.empty(cols, cols)
        symmetric_permute(H.contiguous().numpy(), perm.numpy(), Hp.numpy())
        H = Hp
    fac = inverse_hessian_factor(H, damp, max_tries, name)
    if perm is not None:
        workspace.release(Hp)
    if fac is None:
        log.warning("%s: Hessian stayed singular after %d damping increases; using round-to-nearest",
                    name, max_tries)
        res = rtn_quantize(w, fmt, name)
        res.info.update(method="gptq", fallback="rtn: Hessian not positive definite")
        return res
    U, damp_used = fac
    cfmt = column_format(fmt)
    block = block_size if not grouped else max(g, -(-block_size // g) * g)
    # W held transposed, (cols, rows), in quantisation order: column j is the contiguous row WT[j], a
    # lazy block a slice of rows and its update one in-place matmul; a non-static block is a whole number
    # of groups starting at a group
    order = perm if perm is not None else torch.arange(cols)
    WT = workspace.empty(cols, rows)
    permuted_transpose(W.contiguous().numpy(), order.numpy(), WT.numpy())
    group_of = (order // g).numpy()
    qlo, qhi, off = _int_range(fmt)
    codesT = workspace.empty(cols, rows, dtype=torch.uint8)
    ET_all = workspace.empty(min(block, cols), rows)  # one lazy block's errors, divided by the diagonal
    losses = torch.zeros(rows)
    S_, C_, L_ = scale.numpy(), codesT.numpy(), losses.numpy()
    Z_ = zero.numpy() if zero is not None else np.zeros((1, 1), dtype=np.float32)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        step = b1 - b0 if static else g
        # row i of Hs is row i of the inverse factor divided by its diagonal: eq. 2 for column i is
        # w_k -= e_i Hs[i, k] for the block's later columns k
        d = U[b0:b1, b0:b1].diagonal().contiguous()
        Hs = (U[b0:b1, b0:b1] / d[:, None]).contiguous()
        ET = ET_all[:b1 - b0]
        WT_, Hs_, d_, ET_ = WT[b0:b1].numpy(), Hs.numpy(), d.numpy(), ET.numpy()
        for a in range(b0, b1, step):
            if not static:  # a new group: scales from the current (updated) weights
                with naming(name):
                    s_, z_ = compute_scales(WT[a:a + g].T, cfmt)
                scale[:, a // g] = s_[:, 0]
                if zero is not None:
                    zero[:, a // g] = z_[:, 0]
            quantize_block_columns(WT_, S_, Z_, zero is not None, group_of, Hs_, d_, b0, a, a + step,
                                   np.float32(qlo), np.float32(qhi), np.float32(off), C_, ET_, L_)
        if b1 < cols:  # lazy update of every later column (eq. 4)
            WT[b1:].addmm_(U[b0:b1, b1:].T, ET, alpha=-1)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    gathered_transpose(C_, torch.argsort(order).numpy(), codes.numpy())
    workspace.release(U, WT, codesT, ET_all)
    if fmt.granularity == "tensor":
        scale, zero = scale[:1], (zero[:1] if zero is not None else None)
    res = QuantResult(codes, scale, zero, fmt,
                      {"method": "gptq", "damp": damp_used, "loss": float(losses.sum()),
                       "act_order": act_order, "dead_columns": int(dead.sum())})
    # codes are bounded integers, so the weights are finite when the scales and zero points are
    if not (all_finite(res.scale) and (res.zero is None or all_finite(res.zero))):
        log.warning("%s: GPTQ produced non-finite values; using round-to-nearest", name)
        res = rtn_quantize(w, fmt, name)
        res.info.update(method="gptq", fallback="rtn: non-finite result")
    return res


def layer_output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Relative output error ||X W_hat^T - X W^T|| / ||X W^T|| over captured inputs X (tokens, cols)."""
    ref = x.float() @ w.float().T
    return float((x.float() @ w_hat.float().T - ref).norm() / ref.norm().clamp_min(1e-30))
