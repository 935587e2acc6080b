"""Finding linear layers, replacing them by QuantLinear one at a time, and measuring true model size.

Replacement is layer by layer: a method quantises one linear, `swap_in` puts the QuantLinear in its
place and the full-precision weight is released before the next layer is touched, so quantising never
holds two full copies of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fewbits.models.qlinear import KernelChooser, QuantLinear
from fewbits.tensor import QuantizedTensor

#: module types whose `weight` (out_features, in_features) a recipe can quantise
LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear,)


def linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(full name, module) of every quantisable linear layer, in module order."""
    for name, mod in model.named_modules():
        if type(mod) in LINEAR_TYPES:
            yield name, mod


def linear_shapes(model: nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """(name, (out_features, in_features)) of every quantisable linear layer."""
    return [(n, (int(m.weight.shape[0]), int(m.weight.shape[1]))) for n, m in linear_layers(model)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` at dotted path `name`; return the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def swap_in(model: nn.Module, name: str, replacement: QuantizedTensor | nn.Module,
            chooser: KernelChooser | None = None, tied: set[int] | None = None) -> nn.Module:
    """Replace linear `name` by a QuantLinear over `replacement` (or by a ready module), keeping its bias.

    The old module's weight is released (set to None) so its memory is freed as soon as nothing
    else refers to it.  `tied`: `tied_parameters(model)` taken before the first swap, when swapping
    many layers (otherwise every swap walks all parameters to find out).  Returns the new module.
    """
    old = model.get_submodule(name)
    if isinstance(replacement, QuantizedTensor):
        want = tuple(old.weight.shape)
        if tuple(replacement.shape) != want:
            raise ValueError(f"{name}: quantised weight has shape {replacement.shape}, the layer has {want}")
        bias = old.bias.detach() if getattr(old, "bias", None) is not None else None
        new: nn.Module = QuantLinear(replacement, bias, chooser)
        new.to(old.weight.device)
    else:
        new = replacement
    replace_module(model, name, new)
    if getattr(old, "weight", None) is not None and not _is_shared(model, old.weight, tied):
        old.weight = None  # release the full-precision weight now
    return new


def tied_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that several modules of `model` hold (tied embeddings)."""
    count: dict[int, int] = {}
    for _, q in model.named_parameters(remove_duplicate=False):
        count[id(q)] = count.get(id(q), 0) + 1
    return {i for i, c in count.items() if c > 1}


def _is_shared(model: nn.Module, p: torch.Tensor, tied: set[int] | None = None) -> bool:
    """True when another module of `model` still holds parameter `p`; with `tied`, only parameters
    listed there can be (swapping unties, never ties)."""
    if tied is not None and id(p) not in tied:
        return False
    return any(q is p for q in model.parameters())


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer, each storage counted once (tied weights once), and the
    packed codes that a QuantLinear's kernel holds in its stead (`QuantLinear.held_codes_nbytes`)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    for mod in model.modules():
        tensors += [t for n, t in mod._buffers.items() if t is not None and n not in mod._non_persistent_buffers_set]
        if isinstance(mod, QuantLinear):
            total += mod.held_codes_nbytes
    for t in tensors:
        key = (str(t.device), t.untyped_storage().data_ptr() if t.numel() else id(t))
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
