"""AWQ: activation-aware weight quantisation (Lin, Tang, Tang, Yang, Dang, Gan, Han 2023, "AWQ:
Activation-aware Weight Quantization for LLM Compression and Acceleration").

1. Scale search (section 3.2): weights that meet large activations matter most.  Scale input channel j
   by s_j = mean|x_j|^alpha (normalised so that sqrt(max s * min s) = 1) and pick the exponent alpha on
   a grid in [0, 1) that minimises the output error of the quantised linears
       L(s) = sum_i || Q(W_i diag(s)) (diag(s)^-1 X) - W_i X ||^2           (paper eq. 4-5)
   alpha = 0 is round-to-nearest, so the search never does worse than RTN on the calibration data.
2. The scales are folded exactly into the module that produces X (a norm's weight or the previous
   linear's output rows) and into the columns of every W_i (`fold_scales`).
3. Clipping search: per output channel and group, shrink the range to ratio * max|w| (ratio on a grid)
   where that lowers the group's output error on the calibration inputs (`search_clip`, `apply_clip`).

Searches return plain data (`AWQScales`, a tensor of clip values); applying them is separate.  Everything
runs on the device of the tensors given (the weights' for folding and clipping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, fake_quantize
from fewbits.methods.common import MethodError, check_method_format


@dataclass
class AWQScales:
    """Result of the scale search: per-input-channel scales, the chosen exponent and the loss curve."""

    scales: torch.Tensor  # (in_features,)
    alpha: float
    losses: list[float] = field(default_factory=list)  # one per grid point, alpha = i / n_grid

    @property
    def rtn_loss(self) -> float:
        return self.losses[0]

    @property
    def best_loss(self) -> float:
        return min(self.losses)


def awq_scales_for(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = x_mean^alpha, normalised so that max(s) * min(s) = 1."""
    s = x_mean.float().clamp_min(1e-4).pow(alpha).clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_search_scales(
    x: torch.Tensor, weights: list[torch.Tensor], fmt: Format | str, n_grid: int = 20,
    x_mean: torch.Tensor | None = None, name: str = "linears",
) -> AWQScales:
    """Grid search of the AWQ exponent for linears that share the input `x` (tokens, in_features).

    `x_mean` (per-channel mean |x|) defaults to the mean over `x`; pass the statistic over all
    calibration tokens when `x` is a subsample (or to all-reduce it across processes).
    """
    fmt = check_method_format("awq", fmt)
    x = x.float()
    if x.dim() != 2 or any(w.shape[1] != x.shape[1] for w in weights):
        raise MethodError(f"{name}: inputs {tuple(x.shape)} do not match weights "
                          f"{[tuple(w.shape) for w in weights]}")
    if not all_finite(x):
        raise MethodError(f"{name}: calibration activations contain NaN or inf")
    x_mean = x.abs().mean(0) if x_mean is None else x_mean.to(x.device, torch.float32)
    ws = [w.detach().to(x.device, torch.float32) for w in weights]
    refs = [x @ w.T for w in ws]
    losses: list[float] = []
    for i in range(n_grid):
        s = awq_scales_for(x_mean, i / n_grid)
        xs = x / s
        loss = 0.0
        for w, ref in zip(ws, refs, strict=True):
            wq = fake_quantize(w * s, fmt)  # quantise the scaled weight; X / s undoes the scale
            loss += float(((xs @ wq.T - ref) ** 2).mean())
        losses.append(loss)
    best = min(range(n_grid), key=lambda i: losses[i])
    return AWQScales(awq_scales_for(x_mean, best / n_grid), best / n_grid, losses)


@torch.no_grad()
def fold_scales(
    prev_weight: torch.Tensor, prev_bias: torch.Tensor | None, next_weights: list[torch.Tensor],
    scales: torch.Tensor, prev_kind: str = "norm", norm_plus_one: bool = False,
) -> None:
    """Fold per-channel scales in place: the producer's output is divided by s, the consumers' columns
    multiplied by s, so the float model computes exactly the same function (up to rounding).

    prev_kind "norm": prev_weight (in,) is a norm's gain ((1 + w) when `norm_plus_one`, as in Gemma);
    "linear": prev_weight (in, k) is the previous linear, whose output rows are divided by s.
    """
    s = scales.to(prev_weight.device, torch.float32)
    if prev_kind == "norm":
        if norm_plus_one:
            prev_weight.copy_(((1 + prev_weight.float()) / s - 1).to(prev_weight.dtype))
        else:
            prev_weight.copy_((prev_weight.float() / s).to(prev_weight.dtype))
    elif prev_kind == "linear":
        if prev_weight.shape[0] != s.shape[0]:
            raise MethodError(f"cannot fold {s.shape[0]} scales into a linear with {prev_weight.shape[0]} outputs")
        prev_weight.copy_((prev_weight.float() / s[:, None]).to(prev_weight.dtype))
    else:
        raise MethodError(f"unknown producer kind {prev_kind!r} (norm or linear)")
    if prev_bias is not None:
        prev_bias.copy_((prev_bias.float() / s).to(prev_bias.dtype))
    for w in next_weights:
        w.copy_((w.float() * s).to(w.dtype))


def search_clip(
    w: torch.Tensor, x: torch.Tensor, fmt: Format | str, n_grid: int = 20, max_shrink: float = 0.5,
    chunk: int = 256,
) -> torch.Tensor:
    """Per output channel and group, the clip value ratio * max|w| (ratio in 1 - i/n_grid for
    i < max_shrink * n_grid) that minimises the group's output error on inputs `x` (tokens, in).

    Returns max values of shape (rows, n_groups); `apply_clip` clamps the weight to them.
    """
    fmt = check_method_format("awq", fmt)
    rows, cols = w.shape
    g = fmt.group_size if fmt.granularity == "group" else cols
    ng = cols // g
    xg = x.to(w.device, torch.float32).reshape(-1, ng, g)  # (tokens, n_groups, g), on the weight's device
    best_max = torch.empty(rows, ng, device=w.device)
    for r0 in range(0, rows, chunk):  # chunks of output channels keep memory small
        wg = w[r0:r0 + chunk].detach().float().reshape(-1, ng, g)  # (r, n_groups, g)
        ref = torch.einsum("tng,rng->rnt", xg, wg)
        org_max = wg.abs().amax(-1, keepdim=True)  # (r, n_groups, 1)
        best_err = torch.full(org_max.shape[:2], float("inf"), device=w.device)
        best = org_max[..., 0].clone()
        for i in range(int(max_shrink * n_grid)):
            mx = org_max * (1 - i / n_grid)
            wc = torch.maximum(torch.minimum(wg, mx), -mx)
            wq = fake_quantize(wc.reshape(wc.shape[0], cols), fmt).reshape(wg.shape)
            err = ((torch.einsum("tng,rng->rnt", xg, wq) - ref) ** 2).mean(-1)  # (r, n_groups)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, mx[..., 0], best)
        best_max[r0:r0 + chunk] = best
    return best_max


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """`w` (rows, cols) with every group clamped to [-max, max] (a new tensor)."""
    fmt = check_method_format("awq", fmt)
    rows, cols = w.shape
    ng = max_val.shape[1]
    wg = w.float().reshape(rows, ng, -1)
    mx = max_val.to(w.device, torch.float32).unsqueeze(-1)
    return torch.maximum(torch.minimum(wg, mx), -mx).reshape(rows, cols).to(w.dtype)
