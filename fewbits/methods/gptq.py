"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers").

Quantise the columns of W one at a time; after rounding column q, spread its error over the columns not
yet quantised so that the layer output on the calibration inputs X moves as little as possible
(Optimal Brain Surgeon update with H = 2 X X^T):

    delta_F = -(w_q - quant(w_q)) / [H_F^-1]_qq * (H_F^-1)_{:,q}           (paper eq. 2)

Algorithm 1 of the paper: the rows of the upper Cholesky factor U of H^-1 (H^-1 = U^T U) give every
[H_F^-1] needed; updates are applied lazily, one block of B columns at a time (eq. 4).  `gptq_quantize`
prepares H (damping, dead columns, act-order permutation, the factor, static group scales) and
`gptq_columns` is Algorithm 1 itself, in plain torch on the weight's device.  On CPU the same column loop
runs compiled (`fewbits.methods.gptq_loop`, chosen by `fewbits.methods.backend`).  Both sum in the same
order, so they agree bit for bit wherever the lazy update's matrix product does (it does with this
project's CPU builds: every code of SmolLM2 equal); at worst a code differs where a weight sat on a
rounding tie (tests/methods/test_backend_equivalence.py).

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
* llama.cpp's block types (q4_0 ... q8_0, and the K-quants q4_k, q5_k, q6_k with 256-weight super-blocks
  of sub-block scales and mins): a block plays the part of a group.  Its header is the one llama.cpp's
  reference quantiser picks for the block's weights as updated when quantisation reaches the block (static:
  for the original weights), and each column's codes are the nearest on that header's grid (`BlockGrid`),
  so the codes and headers are the GGUF file's bytes.  They run on the plain torch loop.
"""

from __future__ import annotations

import logging
import os

import torch

from fewbits.formats import ggml
from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, compute_scales
from fewbits.methods import backend as backends
from fewbits.methods import workspace
from fewbits.methods.common import MethodError, QuantResult, check_method_format, column_format, naming
from fewbits.methods.config import GPTQ
from fewbits.methods.linalg import inverse_upper_factor
from fewbits.methods.rtn import rtn_quantize

log = logging.getLogger("fewbits.gptq")

#: columns whose errors reach the rest of their lazy block together (`spread_tile`)
TILE = 8


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


def int_range(fmt: Format) -> tuple[int, int, int]:
    """(lowest, highest) rounded value and the offset that turns it into a stored code: -2^(b-1)..2^(b-1)-1
    on the full symmetric grid, -L..L on the narrow one, 0..2^b-1 with a zero point."""
    return fmt.qmin, fmt.qmax, 2 ** (fmt.bits - 1) if fmt.symmetric else 0


def group_scales(wg: torch.Tensor, fmt: Format, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of one group, from its current weights wg (rows, group): (rows,) each."""
    with naming(name):
        s, z = compute_scales(wg, column_format(fmt))
    return s[:, 0], (z[:, 0] if z is not None else None)


def spread_tile(w_rest: torch.Tensor, err: torch.Tensor, hs: torch.Tensor) -> None:
    """w_rest -= err @ hs in place, for a tile's errors err (rows, m) and factor rows hs (m, n), with the
    sums in the compiled loop's order (`fewbits.methods.gptq_loop._tile_update`) so that both give the same
    bits: a full tile's TILE products summed pairwise, ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)),
    then subtracted once; a partial tile's subtracted one by one."""
    if err.shape[1] == TILE:
        p = err[:, :, None] * hs[None]  # (rows, TILE, n): every product
        while p.shape[1] > 1:
            p = p[:, 0::2] + p[:, 1::2]  # (rows, half as many, n): neighbours summed
        w_rest -= p[:, 0]
        return
    for t in range(err.shape[1]):
        w_rest -= err[:, t:t + 1] * hs[t]


class IntGrid:
    """Rounding on an integer format's grid: group scales (and zero points) in `scale`, `zero` (rows, n_groups),
    filled in by `start` when quantisation reaches a group unless they are static."""

    def __init__(self, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format, order: torch.Tensor, g: int,
                 name: str) -> None:
        self.scale, self.zero, self.fmt, self.g, self.name = scale, zero, fmt, g, name
        self.qlo, self.qhi, self.off = int_range(fmt)
        self.group_of = (order // g).tolist()  # the group of the j-th column quantised (a host list: no sync)

    def start(self, W: torch.Tensor, a: int, a1: int) -> None:
        """A new group (columns a..a1 of W, in quantisation order): its scales from its weights as they are now."""
        s_, z_ = group_scales(W[:, a:a1], self.fmt, self.name)
        self.scale[:, a // self.g] = s_
        if self.zero is not None:
            self.zero[:, a // self.g] = z_

    def round(self, j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (rows,) uint8 of column j (quantisation order) with weights w, and the values they decode to."""
        s = self.scale[:, self.group_of[j]]
        z = self.zero[:, self.group_of[j]] if self.zero is not None else 0.0
        q = torch.clamp(torch.round(w / s), self.qlo - z, self.qhi - z)  # quant(w_q), in units of the scale
        return (q + z + self.off).to(torch.uint8), q * s


class BlockGrid:
    """Rounding on a llama.cpp block type's grids (Q4_0 ... Q6_K, `fewbits.formats.ggml`).  A block's header
    (its fp16 scale, or a K-quant's super-block scales and 6/8-bit sub-block scales and mins) is chosen as
    llama.cpp's reference quantiser chooses it, from the block's weights as updated when quantisation reaches
    its first column (`start`), or once from the original weights when static (act-order: the columns of a
    block are then not quantised together).  Each column's codes are the nearest on that fixed grid
    (`ggml.encode`), so the header bytes and codes are what the GGUF file stores, never rounded again.

    header (rows, blocks * header_bytes) float: the headers' bytes, as `QuantResult.scale` holds them."""

    def __init__(self, header: torch.Tensor, fmt: Format, order: torch.Tensor, static: bool) -> None:
        self.header, self.fmt, self.t = header, fmt, ggml.gtype(fmt)
        rows, cols = header.shape[0], order.numel()
        if static:  # each column's grid, permuted to quantisation order
            s, m = ggml.column_grid(header.to(torch.uint8), fmt, cols)
            self.s, self.m = s[:, order], (m[:, order] if m is not None else None)
        else:
            self.s = torch.zeros(rows, cols, device=header.device)
            self.m = torch.zeros(rows, cols, device=header.device) if self.t.has_min else None

    def start(self, W: torch.Tensor, a: int, a1: int) -> None:
        """A new block (columns a..a1 of W, natural order): llama.cpp's header for its current weights."""
        hb, k = self.t.header_bytes, a // self.t.block
        h = ggml.quantize(W[:, a:a1], self.fmt)[1]  # (rows, header_bytes) uint8
        self.header[:, k * hb:(k + 1) * hb] = h.float()
        s, m = ggml.column_grid(h, self.fmt, a1 - a)
        self.s[:, a:a1] = s
        if m is not None:
            self.m[:, a:a1] = m

    def round(self, j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `IntGrid.round`: the nearest codes of column j on its block's grid, and their exact values."""
        s, m = self.s[:, j], (self.m[:, j] if self.m is not None else None)
        c = ggml.encode(w, s, m, self.fmt)
        return c, ggml.decode(c, s, m, self.fmt)


def gptq_columns(W: torch.Tensor, U: torch.Tensor, order: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, fmt: Format, block: int, static: bool, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 of the paper, on the device of W: quantise the columns of W (rows, cols) in the order
    `order`, U the upper Cholesky factor of the (permuted) inverse Hessian, lazy blocks of `block` columns.

    scale, zero (rows, n_groups): the group scales; with `static` they are given (column order[j] uses
    group order[j] // g), otherwise they are filled in here, each group's from its weights as updated when
    quantisation reaches it.  For a llama.cpp block type, scale holds the block headers' bytes (rows,
    blocks * header_bytes) and zero is None (`BlockGrid`).  Returns the codes (rows, cols) in W's column
    order and every row's OBS loss sum_q (w_q - quant(w_q))^2 / [H^-1]_qq / 2.

    Inside a block, eq. 2 moves the later columns after each column is rounded.  It is applied in tiles of
    TILE columns: within a tile column by column, to the rest of the block once per tile (`spread_tile`).
    In exact arithmetic that is the same update; in float32 it is the order of the compiled CPU loop, so
    the two backends agree bit for bit there, not only up to rounding ties.
    """
    rows, cols = W.shape
    g = fmt.group_size if fmt.granularity == "group" else cols
    grid = BlockGrid(scale, fmt, order, static) if fmt.kind == "ggml" else IntGrid(scale, zero, fmt, order, g, name)
    W = W[:, order]  # (rows, cols), a copy in quantisation order: the loop updates it in place
    Q = torch.empty(rows, cols, dtype=torch.uint8, device=W.device)
    losses = torch.zeros(rows, device=W.device)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        # Algorithm 1 reads [H_F^-1]_qq and (H_F^-1)_{q,:} off row q of the factor (H^-1 <- Cholesky(H^-1)^T)
        d = U[b0:b1, b0:b1].diagonal()
        Hs = U[b0:b1, b0:b1] / d[:, None]  # row i: the factor's row q = b0 + i over its diagonal (eq. 2)
        E = torch.empty(rows, b1 - b0, device=W.device)  # the block's errors divided by d (eq. 4)
        for a in range(b0, b1, b1 - b0 if static else g):  # the block, or one group of it at a time
            a1 = b1 if static else a + g
            if not static:  # a new group: its scales from the weights as updated so far
                grid.start(W, a, a1)
            for t0 in range(a, a1, TILE):
                t1 = min(t0 + TILE, a1)
                err_t = torch.empty(rows, t1 - t0, device=W.device)  # the tile's errors
                for j in range(t0, t1):
                    i = j - b0
                    w = W[:, j]
                    Q[:, j], value = grid.round(j, w)  # quant(w_q)
                    err = w - value
                    E[:, i] = err / d[i]
                    err_t[:, j - t0] = err
                    W[:, j + 1:t1] -= err[:, None] * Hs[i, i + 1:t1 - b0]  # eq. 2 inside the tile
                spread_tile(W[:, t1:b1], err_t, Hs[t0 - b0:t1 - b0, t1 - b0:])  # eq. 2 for the rest of the block
        losses += (E * E).sum(1) / 2
        W[:, b1:].addmm_(E, U[b0:b1, b1:], alpha=-1)  # eq. 4: the block's errors reach every later column
    return Q[:, torch.argsort(order)], losses


def _column_loop(dev: torch.device, backend: str | None, fmt: Format, name: str) -> str:
    """The column loop's backend (`fewbits.methods.backend`).  The compiled loop rounds on integer grids only: a
    llama.cpp block type runs the plain torch loop, and asking for numba by name for one is an error."""
    chosen = backends.choose(dev, backend)
    if fmt.kind != "ggml" or chosen != "numba":
        return chosen
    asked = backend if backend is not None else os.environ.get(backends.ENV, "")
    if asked.strip().lower() == "numba":
        source = "backend argument" if backend is not None else backends.ENV
        raise MethodError(f"{name}: the numba column loop of GPTQ takes integer formats, not {fmt.spec} ({source} "
                          f"asks for numba); use the torch or auto backend, which run {fmt.spec} on torch")
    return "torch"


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
    backend: str | None = None,
) -> QuantResult:
    """GPTQ codes for a weight (rows, cols) given the Hessian (cols, cols) of its inputs (X^T X up to scale).

    Runs on the weight's device (the Hessian is moved there).  `backend` picks the column loop ("torch",
    "numba" or "auto"; default $FEWBITS_CALIB_BACKEND, else auto: numba for CPU tensors).  Returns codes,
    scales and zero points in the layout of `fewbits.formats.quant`; `info` holds the damping used, the OBS
    loss sum (w - q)^2 / [H^-1]_qq and whether the layer fell back to RTN.
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
    W = w.detach().float()  # never written: the column loop works on a copy
    if not all_finite(W):
        raise MethodError(f"{name}: weight of shape {(rows, cols)} contains NaN or inf")
    dev = W.device
    fast = _column_loop(dev, backend, fmt, name) == "numba"
    H = hessian.detach().to(dev, torch.float32)  # never written: copied before any change below
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
    if static:
        with naming(name):
            scale, zero = compute_scales(W, fmt)  # (rows, n_groups) from the original weights
        if fmt.granularity == "tensor":  # broadcast the single scale to every row
            scale = scale.expand(rows, 1).contiguous()
            zero = zero.expand(rows, 1).contiguous() if zero is not None else None
    elif fmt.kind == "ggml":  # block headers' bytes, filled in by the column loop block by block
        scale = torch.zeros(rows, cols // g * ggml.gtype(fmt).header_bytes, device=dev)
        zero = None
    else:  # filled in by the column loop, group by group
        scale = torch.zeros(rows, cols // g, device=dev)
        zero = torch.zeros(rows, cols // g, device=dev) if not fmt.symmetric else None

    # act-order: the columns with the largest Hessian diagonal first; H permuted to quantisation order
    order = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(cols, device=dev)
    Hp = None
    if act_order:
        if fast:
            from fewbits.methods.gptq_loop import permute_hessian

            H = Hp = permute_hessian(H, order)
        else:
            H = H[order][:, order]
    fac = inverse_hessian_factor(H, damp, max_tries, name)
    workspace.release(Hp)
    if fac is None:
        log.warning("%s: Hessian stayed singular after %d damping increases; using round-to-nearest",
                    name, max_tries)
        res = rtn_quantize(W, fmt, name)
        res.info.update(method="gptq", fallback="rtn: Hessian not positive definite")
        return res
    U, damp_used = fac
    block = block_size if not grouped else max(g, -(-block_size // g) * g)
    if fast:
        from fewbits.methods.gptq_loop import gptq_columns_compiled as columns
    else:
        columns = gptq_columns
    codes, losses = columns(W, U, order, scale, zero, fmt, block, static, name)
    workspace.release(U)
    if fmt.granularity == "tensor":
        scale, zero = scale[:1], (zero[:1] if zero is not None else None)
    res = QuantResult(codes, scale, zero, fmt,
                      {"method": "gptq", "damp": damp_used, "loss": float(losses.sum()),
                       "act_order": act_order, "dead_columns": int(dead.sum())})
    # codes are bounded integers, so the weights are finite when the scales and zero points are
    if not (all_finite(res.scale) and (res.zero is None or all_finite(res.zero))):
        log.warning("%s: GPTQ produced non-finite values; using round-to-nearest", name)
        res = rtn_quantize(W, fmt, name)
        res.info.update(method="gptq", fallback="rtn: non-finite result")
    return res


def layer_output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Relative output error ||X W_hat^T - X W^T|| / ||X W^T|| over captured inputs X (tokens, cols)."""
    ref = x.float() @ w.float().T
    return float((x.float() @ w_hat.float().T - ref).norm() / ref.norm().clamp_min(1e-30))
