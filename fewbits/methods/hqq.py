"""HQQ: half-quadratic quantisation (Badri and Shaji 2023, "Half-Quadratic Quantization of Large
Machine Learning Models").  Calibration-free.

Instead of minimising the squared weight error, minimise a sparsity-promoting l_p norm (p < 1) of it,
which tolerates the few large errors of outliers and fits the bulk better:

    min_{z, W_e}  ||W_e||_p^p + beta/2 ||W_e - (W - Q_z^-1(Q_z(W)))||_2^2

solved by alternating (half-quadratic splitting), with beta growing by kappa each step:
    W_e <- shrink_p(W - Q_z^-1(Q_z(W)), beta),  shrink_p(x) = sign(x) relu(|x| - |x|^(p-1) / beta)
    z   <- mean_group(W_q - (W - W_e) / s)                                  (closed form)
Defaults p = 0.7, beta = 10, kappa = 1.01, 20 iterations; the best iterate (mean |W - W_hat|) is kept.

Floating zero points (formats with `-zfp16`, HQQ's own storage): the algorithm of the paper as it is.
The scale is the min-max scale of the group and stays fixed; only the zero point moves, and it is kept
rounded to its storage dtype at every step, so the iterate that is kept is exactly what is stored.

Integer zero points (plain `-asym`): stored with the code width, so after the iterations the zero point is
rounded and the scale refitted in closed form to the same target, s = <W_q - z, W - W_e> / ||W_q - z||^2,
then once more to W itself for the codes at that scale (a Lloyd step: the least-squares scale).
Rounding moves the grid by up to half a step, which undoes much of the optimisation.
Symmetric formats (no zero point) optimise the scale that way.

Which storage to pick (SmolLM2-135M, mean KL to the float model; HQQ beats RTN with either): at 4 bits
the float zero point wins clearly; at 3 and 2 bits integer zero points win, for RTN and HQQ alike,
although every weight-space error (l_0.7, l_1, l_2) is lower with float zeros. The reason is where 0
lands: integer zeros keep 0 on the grid, so the many tiny weights (those that meet the outlier
activation channels among them) stay tiny; a float zero shifts the grid by a fraction of a step, and
every tiny weight picks up that offset, which the outlier activations amplify. Shifting integer zeros by
a quarter of a step at 3 bits doubles the KL while barely changing the weight error. HQQ's objective is
a weight-space one and cannot see it.
"""

from __future__ import annotations

import torch

from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, compute_scales, quantize_codes, round_scale, round_zero
from fewbits.methods.common import QuantResult, check_method_format, naming


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalised soft-thresholding: the proximal operator of the l_p (p < 1) penalty."""
    return torch.sign(x) * torch.relu(x.abs() - x.abs().clamp_min(1e-12).pow(p - 1) / beta)


def _codes(W: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    if z is None:  # the format's grid (full: -2^(b-1)..2^(b-1)-1 with a signed scale; narrow: -L..L)
        return torch.round(W / s).clamp(fmt.qmin, fmt.qmax)
    # HQQ's rule round(W / s + z): the zero point is a float while it is optimised, whatever is stored
    return torch.round(W / s + z).clamp(0, 2**fmt.bits - 1)


def _deq(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    return (q - z) * s if z is not None else q * s


def _refit_scale(q: torch.Tensor, z: torch.Tensor | None, target: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    v = q - z if z is not None else q
    den = (v * v).sum(-1, keepdim=True)
    new = (v * target).sum(-1, keepdim=True) / den.clamp_min(1e-12)
    return torch.where((den > 0) & (new * s > 0), new, s)  # the sign is kept (full grid: s < 0 is allowed)


def hqq_quantize(
    w: torch.Tensor, fmt: Format | str, *, iters: int = 20, p: float = 0.7, beta: float = 10.0,
    kappa: float = 1.01, name: str = "weight",
) -> QuantResult:
    """HQQ codes, scales and zero points for a weight (rows, cols) in an integer format.

    `info["l1_error"]` is the mean |W - W_hat| of the kept iterate (before the scale is rounded in the
    integer-zero and symmetric paths), `info["iters"]` the iterations run.
    """
    fmt = check_method_format("hqq", fmt)
    if w.dim() != 2:
        raise ValueError(f"{name}: hqq expects a 2-D weight, got shape {tuple(w.shape)}")
    fmt.check_shape(tuple(w.shape), name)
    w = w.detach().float()
    if not all_finite(w):
        raise ValueError(f"{name}: weight of shape {tuple(w.shape)} contains NaN or inf")
    rows, cols = w.shape
    with naming(name):
        scale0, zero0 = compute_scales(w, fmt)
    shape_s = scale0.shape
    W = w.reshape(shape_s[0] * shape_s[1], -1)  # one row per group: (rows * n_groups, group)
    s = scale0.reshape(-1, 1).clone()
    z = zero0.reshape(-1, 1).clone() if zero0 is not None else None
    best = (s.clone(), None if z is None else z.clone())
    best_err = float("inf")
    done = 0
    for done in range(1, iters + 1):  # noqa: B007 - `done` is reported
        q = _codes(W, s, z, fmt)
        r = W - _deq(q, s, z)
        err = float(r.abs().mean())
        if err < best_err:
            best_err, best = err, (s.clone(), None if z is None else z.clone())
        elif err > best_err * 1.0001:
            break
        target = W - shrink_lp(r, beta, p)
        if z is not None:  # closed-form zero update with the scale fixed, kept in its storage precision
            z = round_zero((q - target / s).mean(-1, keepdim=True), fmt)
        else:
            s = _refit_scale(q, None, target, s)
        beta *= kappa
    s, z = best
    # storage: integer zero points, then the scale refitted (least squares) and rounded to its dtype
    if z is not None and not fmt.float_zeros:
        z = torch.round(z).clamp(0, 2**fmt.bits - 1)
        q = _codes(W, s, z, fmt)
        target = W - shrink_lp(W - _deq(q, s, z), beta, p)
        s = _refit_scale(q, z, target, s)
        # one Lloyd step: the codes at that scale, then the scale with the least squared error for them
        s = _refit_scale(_codes(W, s, z, fmt), z, W, s)
    with naming(name):
        s = round_scale(s, fmt).reshape(shape_s)
    z = z.reshape(shape_s) if z is not None else None
    codes = quantize_codes(w, s, z, fmt)
    return QuantResult(codes, s, z, fmt, {"method": "hqq", "l1_error": best_err, "iters": done})
