"""What keeps a failed `api.quantize` from leaving a silently wrong model.

Before any layer changes, `check_layers` runs every per-layer check that can fail (the method takes the
format, the weight is finite, the scales fit the format's scale dtype), so a refused model is exactly as
it was.  A failure after the first change (an error half-way, Ctrl-C) cannot be undone without a second
copy of the weights; `mark_unusable` then makes the model say so: its forward raises, and saving it
(`refuse_if_unusable`) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fewbits.models.recipe import LayerPlan, RecipeError

#: attribute set on a model whose `quantize` failed half-way; its forward then raises
UNUSABLE_ATTR = "fewbits_unusable"


class QuantizeError(RecipeError):
    """A model and recipe that cannot be quantised together, or a quantisation that stopped half-way (the
    message says whether the model was changed)."""


def check_layers(model: nn.Module, todo: Sequence[LayerPlan]) -> None:
    """Raise, naming the layer, where a planned layer cannot be quantised: a method that does not take the
    format (its typed config says which it takes; a plugged-in method without one checks its own), NaN/inf
    weights, or scales its scale dtype cannot hold (`formats.quant.check_scale_range`).  The options
    themselves were checked when the recipe was built (`fewbits.methods.config`)."""
    from fewbits.formats.format import parse_format
    from fewbits.formats.quant import all_finite, as_2d, compute_scales
    from fewbits.methods.common import MethodError, naming
    from fewbits.methods.registry import METHODS

    for p in todo:
        fmt = parse_format(p.format)
        if not fmt.is_quantized:
            continue
        config = p.config if p.config is not None else METHODS[p.method].config()
        problem = config.format_problem(fmt, p.method)
        if problem:
            raise MethodError(f"{p.name}: {problem}")
        w = model.get_submodule(p.name).weight.detach()
        if not all_finite(w):
            n_bad = int((~torch.isfinite(w)).sum())
            raise QuantizeError(f"{p.name}: weight of shape {tuple(w.shape)} has {n_bad} NaN or inf values; "
                                "nothing was quantised")
        with naming(p.name):  # in float32: the same group extremes, reduced ~4-8x faster than in bf16 on a CPU
            compute_scales(as_2d(w if w.dtype == torch.float64 else w.float()), p.format)


def mark_unusable(model: nn.Module, reason: str) -> None:
    """Make a half-quantised model refuse to run: its forward raises naming `reason`."""
    if getattr(model, UNUSABLE_ATTR, None):
        return

    def refuse(mod: nn.Module, args: Any, kwargs: Any = None) -> None:
        raise RuntimeError(f"this model is unusable: {reason}; load it again")

    setattr(model, UNUSABLE_ATTR, reason)
    model.register_forward_pre_hook(refuse, with_kwargs=True)


def stopped_half_way(model: nn.Module, exc: BaseException, method: str, done: int, total: int) -> None:
    """`model` was changed before `exc` stopped method `method` after `done` of `total` layers: mark it
    unusable, and make the exception's message say so (same exception type; a note where it has no
    one-string message, e.g. KeyboardInterrupt).  The caller re-raises."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    mark_unusable(model, f"quantize stopped in method {method} after {done} of {total} layers "
                         f"({type(exc).__name__}: {first})")
    note = (f"the model was changed in place before this ({done} of {total} layers swapped; calibrated methods "
            "also change weights they have not swapped yet) and is now unusable: load it again")
    if isinstance(exc, Exception) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}; {note}",)
    else:
        exc.add_note(f"fewbits: {note}")


def refuse_if_unusable(model: nn.Module, action: str) -> None:
    """QuantizeError when `model` was marked unusable (`action`: what was asked, e.g. "save")."""
    reason = getattr(model, UNUSABLE_ATTR, None)
    if reason:
        raise QuantizeError(f"cannot {action}: the model is unusable ({reason})")


__all__ = ["QuantizeError", "check_layers", "mark_unusable", "stopped_half_way", "refuse_if_unusable",
           "UNUSABLE_ATTR"]
