"""What every export target shares: its error, and the model's quantised layers."""

from __future__ import annotations

from torch import nn

from fewbits.models.moe import has_routed_experts
from fewbits.models.qlinear import QuantLinear


class ExportError(ValueError):
    """A model (or one of its layers) that the target layout cannot hold; nothing has been written."""


def quantised_layers(model: nn.Module, target: str, require: bool = True) -> dict[str, QuantLinear]:
    """name -> QuantLinear of `model`; any other replaced layer (a fewbits wrapper: an outlier split,
    activation quantisation) is refused by name, as is a model without quantised layers when `require`."""
    if has_routed_experts(model):
        raise ExportError(f"mixture-of-experts models have no {target} export in fewbits yet (its expert "
                          "layout is not written); save with fewbits' own format (no --to)")
    layers: dict[str, QuantLinear] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            layers[name] = mod
        elif getattr(type(mod), "layer_kind", None):
            raise ExportError(f"{name}: a {type(mod).__name__} layer ({type(mod).layer_kind}) has no "
                              f"{target} form; quantise it as a plain weight format")
    if require and not layers:
        raise ExportError("the model has no quantised linear layers (run fewbits.api.quantize first)")
    return layers
