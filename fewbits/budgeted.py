"""Mixed precision under a budget: measure each layer's sensitivity, pick one format per layer, write a recipe.

    mix = budget_recipe(model, data, Budget.parse("bpw=4.25"), ["int3-g64", "int4-g64", "int8"], "gptq")
    api.quantize(model, mix.recipe, data)

A budget is bits per weight over the quantised linears (`bpw=4.25`), the whole model's bytes
(`size=1.2GB`: the 16-bit embeddings, norms and head count too) or the cost model's predicted batch-1
decode step on a device (`step-ms=8 --device h100`).  Sensitivities come from
`fewbits.calib.sensitivity.measure` (a KL proxy per layer and candidate, in nats per token), the pick
from `fewbits.methods.budget.choose` (exact multiple-choice knapsack), bytes from the formats' exact
storage and time from `fewbits.cost.mix`.  The result is a `Recipe` with one rule per layer (it
reloads, saves as TOML/JSON and quantises like any other) and the figures behind it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from fewbits.formats.format import FormatError, parse_format
from fewbits.methods.budget import BudgetError, choose
from fewbits.models.moe import has_experts
from fewbits.models.recipe import DEFAULT_IGNORE, Recipe, Rule
from fewbits.models.swap import linear_shapes, model_nbytes

#: candidates when none are given: 3 to 8 bits, all symmetric with 16-bit scales
DEFAULT_CANDIDATES = ("int3-g64", "int3-g32", "int4-g64", "int4-g32", "int5-g64", "int5-g32", "int6-g64", "int8")
#: decode context (tokens per sequence, batch 1) at which a step-ms budget is costed
STEP_CONTEXT = 2048
#: calibration samples on which each layer's proxy is rescaled by its true single-layer KL (one forward pass of
#: this many samples per layer).  0, the raw proxy: on SmolLM2-135M GPTQ at 4.25 bits the rescaled mix
#: measured KL 0.108 against the raw proxy's 0.099 (benchmarks/results/budget/report.md)
TRUTH_WINDOWS = 0
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
BudgetKind = Literal["bpw", "size", "step-ms"]


@dataclass(frozen=True)
class Budget:
    """What the mix may spend: bits per weight, bytes of the whole model, or ms of a decode step."""

    kind: BudgetKind
    value: float

    @classmethod
    def parse(cls, text: str) -> Budget:
        """`bpw=4.25`, `size=1.2GB` (also MB, KB, GiB, MiB, plain bytes) or `step-ms=8.5`."""
        key, sep, val = text.partition("=")
        key, val = key.strip().lower(), val.strip()
        if not sep or key not in ("bpw", "size", "step-ms"):
            raise BudgetError(f"budget {text!r}: write bpw=BITS, size=BYTES (e.g. 1.2GB) or step-ms=MS")
        num = val
        mult = 1.0
        if key == "size":
            m = re.fullmatch(r"([0-9.eE+-]+)\s*([a-zA-Z]*)", val)
            if not m or m.group(2).lower() not in _UNITS:
                raise BudgetError(f"budget {text!r}: a size is a number with B, KB, MB, GB, KiB, MiB or GiB")
            num, mult = m.group(1), _UNITS[m.group(2).lower()]
        try:
            v = float(num) * mult
        except ValueError:
            raise BudgetError(f"budget {text!r}: {val!r} is not a number") from None
        if not v > 0 or v == float("inf"):
            raise BudgetError(f"budget {text!r}: must be a positive number")
        return cls(key, v)  # type: ignore[arg-type]

    @property
    def text(self) -> str:
        return {"bpw": f"bpw={self.value:g}", "size": f"size={self.value:.6g} bytes",
                "step-ms": f"step-ms={self.value:g}"}[self.kind]


@dataclass
class MixPlan:
    """A budgeted mix: the recipe and the numbers it was chosen from."""

    recipe: Recipe
    budget: Budget
    formats: dict[str, str]  # layer -> chosen format
    proxy_kl: float  # summed sensitivity of the pick (nats/token, predicted)
    linear_bytes: int
    bits_per_weight: float
    model_bytes: int  # the whole model stored with this mix (16-bit parts included)
    step_s: float | None  # predicted batch-1 decode step on `device`
    device: str | None
    sensitivity: dict[str, Any] = field(default_factory=dict)
    uniform: dict[str, dict[str, float]] = field(default_factory=dict)  # per candidate, same figures

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.formats.values():
            out[f] = out.get(f, 0) + 1
        return out

    def text(self) -> str:
        per = ", ".join(f"{n} x {f}" for f, n in sorted(self.counts().items()))
        step = f"; predicted decode step {1e3 * self.step_s:.3f} ms on {self.device}" if self.step_s else ""
        return (f"budget {self.budget.text}: {per}\n  linears {self.linear_bytes:,} bytes ({self.bits_per_weight:.3f} "
                f"bits/weight), model {self.model_bytes:,} bytes{step}; predicted KL {self.proxy_kl:.4f}")

    def to_dict(self) -> dict[str, Any]:
        return {"budget": {"kind": self.budget.kind, "value": self.budget.value}, "formats": self.formats,
                "proxy_kl": self.proxy_kl, "linear_bytes": self.linear_bytes, "bits_per_weight": self.bits_per_weight,
                "model_bytes": self.model_bytes, "step_s": self.step_s, "device": self.device,
                "uniform": self.uniform, "recipe": self.recipe.to_dict(), "sensitivity": self.sensitivity}


def _model_spec(model: nn.Module) -> Any:
    from fewbits.models.spec import ModelSpec

    return ModelSpec.from_config_dict(model.config.to_dict(), source="model config")


def budget_recipe(model: nn.Module, data: torch.Tensor, budget: Budget | str, candidates: Sequence[str] | None = None,
                  method: str = "rtn", device: str | None = None, profile: str = "default",
                  ignore: Sequence[str] = DEFAULT_IGNORE, progress: bool = False, sensitivity: Any = None,
                  truth_windows: int = TRUTH_WINDOWS) -> MixPlan:
    """One candidate format per linear layer minimising the summed KL proxy within `budget`.

    data: calibration token ids (n, seq).  device/profile: the cost model's device and profile for
    the predicted step time (a step-ms budget needs a device; others report it when one is given).
    sensitivity: a `fewbits.calib.sensitivity.Sensitivity` measured before (same layers and
    candidates), to choose several budgets from one measurement.  truth_windows: calibration samples on
    which each layer's proxy is rescaled by its true single-layer KL (0: the raw proxy; see
    `fewbits.calib.sensitivity.calibrate`).  The model is not changed."""
    from fewbits.calib.sensitivity import measure

    budget = Budget.parse(budget) if isinstance(budget, str) else budget
    cands = [parse_format(c).spec for c in (candidates or DEFAULT_CANDIDATES)]
    if len(set(cands)) != len(cands) or not all(parse_format(c).is_quantized for c in cands):
        raise BudgetError(f"candidates {', '.join(cands)}: give distinct quantised formats")
    if budget.kind == "step-ms" and device is None:
        raise BudgetError("a step-ms budget needs the device it is predicted on (--device, e.g. h100)")
    probe = Recipe((Rule(".*", "int8", "rtn"),), tuple(ignore))  # which layers: per-channel int8 fits any
    if has_experts(model):
        raise BudgetError("mixture-of-experts models: --budget cannot measure the experts' sensitivity yet (an "
                          "expert's outputs are its routed tokens, not the calibration positions); use --format")
    layers = [(p.name, p.shape) for p in probe.plan(linear_shapes(model)) if p.action == "quantize"]
    for name, shape in layers:
        for c in cands:
            try:
                parse_format(c).check_shape(shape, name)
            except FormatError as e:
                raise BudgetError(f"candidate {c} does not fit: {e}") from None
    dev = prof = spec = None
    if device is not None:
        from fewbits.cost.plan import load_profile, pick_device

        prof = load_profile(profile)
        dev = pick_device(device, prof)
        spec = _model_spec(model)
    names = [n for n, _ in layers]
    sens = sensitivity if sensitivity is not None else measure(model, data, names, cands, method, progress,
                                                                 truth_windows=truth_windows)
    missing = [n for n in names if n not in sens.kl or any(c not in sens.kl[n] for c in cands)]
    if missing:
        raise BudgetError(f"the sensitivity given lacks {len(missing)} layer/candidate pair(s), e.g. {missing[0]}")
    s = [[sens.effective(n, c) for c in cands] for n in names]
    nbytes = [[parse_format(c).nbytes(shape) for c in cands] for _, shape in layers]
    numel = sum(sh[0] * sh[1] for _, sh in layers)
    fixed_bytes = model_nbytes(model) - sum(model.get_submodule(n).weight.numel()
                                            * model.get_submodule(n).weight.element_size() for n in names)
    if budget.kind == "bpw":
        costs, limit = [[8 * b for b in row] for row in nbytes], budget.value * numel
    elif budget.kind == "size":
        costs, limit = nbytes, budget.value - fixed_bytes
    else:
        from fewbits.cost.mix import fixed_time, layer_time

        costs = [[layer_time(c, shape, dev, prof) for c in cands] for _, shape in layers]
        limit = budget.value / 1e3 - fixed_time(spec, cands[0], dev, prof, STEP_CONTEXT)
    try:
        pick = choose(costs, s, limit)
    except BudgetError as e:
        raise BudgetError(f"budget {budget.text} cannot be met with candidates {', '.join(cands)}: {e}") from None
    formats = {n: cands[j] for n, j in zip(names, pick.picks, strict=True)}
    recipe = Recipe(tuple(Rule(f"^{re.escape(n)}$", f, method) for n, f in formats.items()), tuple(ignore))

    def figures(chosen: dict[str, str]) -> dict[str, float]:
        lin = sum(parse_format(chosen[n]).nbytes(sh) for n, sh in layers)
        out = {"linear_bytes": lin, "bits_per_weight": 8 * lin / numel, "model_bytes": fixed_bytes + lin,
               "proxy_kl": sum(sens.effective(n, chosen[n]) for n in names)}
        if dev is not None:
            from fewbits.cost.mix import mixed_time

            out["step_s"] = mixed_time(spec, [(sh, chosen[n]) for n, sh in layers], cands[0], dev, prof, STEP_CONTEXT)
        return out

    mine = figures(formats)
    uniform = {c: figures(dict.fromkeys(names, c)) for c in cands}
    return MixPlan(recipe, budget, formats, mine["proxy_kl"], int(mine["linear_bytes"]), mine["bits_per_weight"],
                   int(mine["model_bytes"]), mine.get("step_s"), dev.name if dev is not None else None,
                   sens.to_dict(), uniform)
