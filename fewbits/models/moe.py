"""Mixture-of-experts: the fused expert weights of a transformers MoE block as one linear layer per expert.

transformers (5.x) stores the experts of a Mixtral, Qwen2-MoE or Qwen3-MoE block as two 3-D parameters,
``gate_up_proj`` (E, 2I, H: each expert's gate rows, then its up rows) and ``down_proj`` (E, H, I).
`unfuse_experts` replaces that module by `RoutedExperts`: a list of E gated MLPs with ``gate_proj``,
``up_proj`` and ``down_proj`` as `nn.Linear` layers holding the same numbers, and a forward that routes
tokens exactly as the fused module does.  From then on an expert's linear is an ordinary linear layer
named ``model.layers.3.mlp.experts.5.down_proj``, so everything fewbits does to linears applies to it
unchanged: recipes address it by name, `swap_in` puts a QuantLinear (with the fast kernels) in its
place, the report and the byte counts list it, and fewbits' own save format stores and reloads it.

Calibration needs no hook of its own: the forward calls expert e's linears on the tokens the router sent
to e, and nothing else, so the ordinary input statistics of those linears (their Hessians included) are
the statistics of the routed tokens, unweighted by the routing weight (see `fewbits.calib.moe`).

The router (``mlp.gate``) is not a linear layer here and stays as it is.  Where the experts live is
architecture data (`ArchMapping.experts`); the fused layout (gate rows before up rows, no bias, weights
not transposed) is checked against the flags transformers' ``use_experts_implementation`` sets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fewbits.models.mappings import UnknownArchitectureError, find_blocks_path, mapping_for_config


class ExpertLayoutError(ValueError):
    """An experts module whose fused layout is not the one `unfuse_experts` knows."""


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear over `weight` (out, in), built without initialising a throw-away weight."""
    lin = nn.Linear(int(weight.shape[1]), int(weight.shape[0]), bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), as the fused module computes it for its tokens."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: Callable) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(gate), _linear(up), _linear(down)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.ModuleList):
    """Drop-in for transformers' fused experts module: ``forward(hidden (T, H), top_k_index (T, k),
    top_k_weights (T, k)) -> (T, H)``, expert e's MLP run on the tokens routed to it, scaled by their
    routing weights and summed, experts in ascending order and each expert's tokens in the fused module's
    order (by top-k slot, then token), so the sums are added in the same order."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        slots = top_k_index.T  # (k, T): the fused module walks slot by slot
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:  # the fused module skips indices outside (expert parallelism)
                continue
            pos, tokens = torch.where(slots == e)  # (n,), (n,)
            y = self[e](hidden_states[tokens]) * top_k_weights[tokens, pos, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


def _fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(full name, module) of every fused experts module of `model`, from the architecture mapping."""
    try:
        arch = mapping_for_config(getattr(model, "config", None))
    except UnknownArchitectureError:  # no mapping (a plain module, an unlisted family): no experts known
        return []
    if not arch.experts:
        return []
    blocks = find_blocks_path([n for n, _ in model.named_modules()], arch)
    out = []
    for i, block in enumerate(model.get_submodule(blocks)):
        try:
            mod = block.get_submodule(arch.experts)
        except AttributeError:  # a dense layer of a MoE model (Qwen2-MoE's mlp_only_layers)
            continue
        if not isinstance(mod, RoutedExperts):
            out.append((f"{blocks}.{i}.{arch.experts}", mod))
    return out


def _check_layout(name: str, mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)) or gate_up.dim() != 3:
        raise ExpertLayoutError(f"{name}: a {type(mod).__name__} without 3-D gate_up_proj and down_proj "
                                "parameters; its experts cannot be split into linear layers")
    flags = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}
    odd = [f"{k}={getattr(mod, k)}" for k, v in flags.items() if getattr(mod, k, v) != v]
    e, two_i, h = gate_up.shape
    if odd or two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise ExpertLayoutError(f"{name}: fused experts of shapes {tuple(gate_up.shape)} and {tuple(down.shape)}"
                                + (f" ({', '.join(odd)})" if odd else "") + " are not the layout fewbits splits "
                                "(E x 2I x H gate rows then up rows, E x H x I)")
    return gate_up, down


@torch.no_grad()
def unfuse_experts(model: nn.Module, copy: bool = True) -> list[str]:
    """Replace every fused experts module of `model` by `RoutedExperts` (exactly the same numbers, one
    nn.Linear per expert projection); returns the names of the modules replaced (none for a dense model
    or one already split).  One block at a time: the fused tensors are released as each block is split,
    so memory holds one extra block's experts at most.  `copy=False` leaves the new weights uninitialised
    (for a model whose weights are about to be loaded)."""
    done = []
    for name, mod in _fused_experts(model):
        gate_up, down = _check_layout(name, mod)
        i = int(down.shape[-1])

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if copy else torch.empty_like(t)

        experts = [ExpertMLP(take(gate_up[e, :i]), take(gate_up[e, i:]), take(down[e]), mod.act_fn)
                   for e in range(int(gate_up.shape[0]))]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, RoutedExperts(experts))
        mod.gate_up_proj = mod.down_proj = None  # release the fused weights now
        done.append(name)
    return done


def has_experts(model: nn.Module) -> bool:
    """Whether `model` is a mixture-of-experts model fewbits knows (experts fused or already split)."""
    return has_routed_experts(model) or bool(_fused_experts(model))


def has_routed_experts(model: nn.Module) -> bool:
    """Whether `model` holds experts split by `unfuse_experts`."""
    return any(isinstance(m, RoutedExperts) for m in model.modules())
