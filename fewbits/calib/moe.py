"""Calibrating mixture-of-experts layers: which experts saw too few routed tokens to be calibrated.

An expert's linears see only the tokens the router sent to that expert (`fewbits.models.moe` runs them on
exactly those), so their statistics, GPTQ's Hessian H = sum_t x_t x_t^T included, come from those tokens
alone.  The tokens are not weighted by their routing weight: GPTQ's objective for the expert is then the
error of the expert's own output on its tokens, ||(W - W') X_e||^2, as for any linear layer.  Weighting
each token by its squared routing weight g_t^2 would match the error of the block's output on the
calibration text instead, but it would lean on weights that are themselves a property of that text (a
token the expert handles with a small weight here is an input it must still handle well), and it shrinks
the effective number of tokens behind H, which is already the scarce quantity for a rarely chosen
expert.  An unweighted H is also the one every other layer uses: one code path, one set of checks.

An expert that saw fewer tokens than `expert_min_tokens` x its input width gets round-to-nearest with a log
line: its H has rank at most its token count, and GPTQ pushes the rounding error into the input
directions the calibration never showed (there only the damping term stands in H), which the model's
real inputs do reach; AWQ's scale and clipping searches would fit a handful of tokens.  The default 1.0
is the least data for which H can have full rank; dense layers see every calibration token, so the rule
is for experts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fewbits.calib.stats import HESSIAN_CHUNKS, InputStats
from fewbits.methods.config import EXPERT_MIN_TOKENS
from fewbits.models.mappings import ArchMapping

#: GPTQ collects the Hessians of a group of experts in passes that hold at most about this many bytes of
#: them (a Mixtral block: its 8 experts' gate/up Hessians in one pass, 4096^2 floats each, and its
#: down_proj Hessians, 14336^2 each, one per pass); a dense group is always one pass
EXPERT_HESSIAN_BYTES = 2 << 30


def min_expert_tokens(plan: Any) -> float:
    """The plan's `expert_min_tokens` option (a fraction of the input width), EXPERT_MIN_TOKENS if unset."""
    return float(getattr(plan.config, "expert_min_tokens", EXPERT_MIN_TOKENS))


def starved_experts(arch: ArchMapping, paths: Iterable[str], stats: Mapping[str, InputStats],
                    plans: Mapping[str, Any]) -> dict[str, str]:
    """path -> reason, for each expert linear among `paths` (inside a block) whose calibration saw fewer
    routed tokens than its plan's `expert_min_tokens` x its input width."""
    out: dict[str, str] = {}
    for p in paths:
        if not arch.is_expert(p):
            continue
        st, frac = stats[p], min_expert_tokens(plans[p])
        if st.tokens < frac * st.in_features:
            out[p] = (f"the router sent this expert {st.tokens} calibration token(s), fewer than "
                      f"expert_min_tokens {frac:g} x its {st.in_features} inputs")
    return out


def hessian_passes(arch: ArchMapping, group: tuple[str, ...], in_features: Mapping[str, int],
                   budget: int | None = None) -> list[tuple[str, ...]]:
    """`group` (planned paths of one sequential group) cut into groups whose statistics are collected in
    one pass each: whole experts, as many per pass as keep their Hessians (float32 partial sums and the
    mean GPTQ factorises) within `budget` bytes (default EXPERT_HESSIAN_BYTES), at least one.  A group
    without experts is one pass."""
    budget = EXPERT_HESSIAN_BYTES if budget is None else budget
    sets = arch.same_input(group)
    if len(sets) < 2:
        return [group]
    out: list[tuple[str, ...]] = []
    cur: tuple[str, ...] = ()
    held = 0
    for s in sets:
        need = 4 * (HESSIAN_CHUNKS + 1) * in_features[s[0]] ** 2
        if cur and held + need > budget:
            out.append(cur)
            cur, held = (), 0
        cur, held = cur + s, held + need
    return out + [cur]
