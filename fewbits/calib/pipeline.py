"""Method runners for `fewbits.api.METHODS`: the glue between the block-by-block calibration loop,
the declared architecture mappings and the pure maths of `fewbits.methods`.

Each runner has the api's signature ``runner(model, layers, data, commit, progress) -> info`` and
quantises every planned layer exactly once.  Formats are checked for the method before anything
changes.  Layers the calibration never reaches (outside the decoder blocks, or an expert no token was
routed to) fall back to round-to-nearest with a log line; the returned info lists them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, closing
from typing import Any

import torch
from torch import nn

from fewbits.calib.moe import hessian_passes, starved_experts
from fewbits.calib.runner import BlockRun, check_calibration_data, decoder_blocks, iterate_blocks
from fewbits.calib.stats import InputStats
from fewbits.formats.format import parse_format
from fewbits.formats.quant import all_finite
from fewbits.methods import workspace
from fewbits.methods.awq import apply_clip, awq_search_scales, fold_scales, search_clip
from fewbits.methods.common import MethodError, QuantResult, check_method_format
from fewbits.methods.config import AWQ, AWQGPTQ, GPTQ, HQQ, MethodConfig
from fewbits.methods.gptq import gptq_quantize
from fewbits.methods.rtn import rtn_quantize
from fewbits.models.mappings import ArchMapping, SmoothMapping

log = logging.getLogger("fewbits.calib")
Commit = Callable[[str, Any], None]

#: linears whose clipping AWQ does not search (their outputs meet in a softmax; as in the paper's code)
AWQ_NO_CLIP = re.compile(r"(^|\.)(q_proj|k_proj|query|key)$")


def _split_by_block(model: nn.Module, layers: Sequence[Any]) -> tuple[str, ArchMapping, dict[int, dict[str, Any]],
                                                                        list[Any]]:
    """Planned layers grouped per block index as {path inside block: plan}, plus those outside blocks."""
    prefix, _, arch = decoder_blocks(model)
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$")
    by_block: dict[int, dict[str, Any]] = {}
    outside = []
    for p in layers:
        m = pat.match(p.name)
        if m:
            by_block.setdefault(int(m.group(1)), {})[m.group(2)] = p
        else:
            outside.append(p)
    return prefix, arch, by_block, outside


def _groups(arch: ArchMapping, planned: dict[str, Any]) -> list[tuple[tuple[str, ...], bool]]:
    """Sequential groups of planned paths; (group, declared) - undeclared paths come last, together."""
    out = [(tuple(p for p in g if p in planned), True) for g in arch.sequential]
    # a group of experts may take several passes, to bound the memory its Hessians hold
    out = [(c, d) for g, d in out if g for c in hessian_passes(arch, g, {p: planned[p].shape[1] for p in g})]
    rest = tuple(p for p in planned if p not in arch.linears)
    return out + ([(rest, False)] if rest else [])


def _rtn_commit(model: nn.Module, plan: Any, commit: Commit, reason: str, info: dict[str, Any]) -> None:
    log.warning("%s: %s; using round-to-nearest", plan.name, reason)
    w = model.get_submodule(plan.name).weight
    commit(plan.name, rtn_quantize(w, plan.format, plan.name).to_tensor(tuple(w.shape)))
    info.setdefault("rtn_fallback", {})[plan.name] = reason


def _committer(commit: Commit, name: str, res: QuantResult) -> Callable[[], None]:
    return lambda: commit(name, res.to_tensor(tuple(res.codes.shape)))


def _check(layers: Sequence[Any], method: str) -> None:
    for p in layers:
        check_method_format(method, p.format)


def plan_config(plan: Any, cls: type[MethodConfig]) -> Any:
    """The plan's typed options (`fewbits.methods.config`); the method's defaults for a plan built without."""
    cfg = getattr(plan, "config", None)
    if cfg is None:
        return cls()
    if not isinstance(cfg, cls):
        raise MethodError(f"{plan.name}: options {type(cfg).__name__} are not those of {cls.__name__}")
    return cfg


def _awq_opts(plan: Any) -> AWQ:
    """AWQ's options for a plan of awq or awq+gptq (which folds scales without clipping)."""
    cfg = getattr(plan, "config", None)
    if isinstance(cfg, AWQGPTQ):
        return AWQ(grid=cfg.grid, clip=False, search_tokens=cfg.search_tokens)
    return plan_config(plan, AWQ)


# ---------------------------------------------------------------------- AWQ
def smooth_modules(run: BlockRun, m: SmoothMapping) -> tuple[nn.Module, list[nn.Module]] | None:
    """The module whose output feeds a smoothing group (a norm or a linear) and the group's linears, which AWQ and
    SmoothQuant scale against each other; None where the block lacks one of them or a linear producer's rows do
    not line up with its consumers' columns (v_proj -> o_proj with grouped-query attention)."""
    try:
        prev = run.module(m.prev)
        consumers = [run.module(p) for p in m.linears]
    except AttributeError:
        return None
    if m.prev_kind == "linear" and prev.weight.shape[0] != consumers[0].weight.shape[1]:
        return None
    return prev, consumers


def awq_block(run: BlockRun, planned: dict[str, Any], arch: ArchMapping, clip: bool,
              info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Search and fold AWQ scales for one block (all mappings from one pass over the float block);
    with `clip`, also search clipping.  Returns {path: weight to quantise} (clipped when searched)."""
    seq = int(run.hidden[0].shape[-2]) if run.hidden else 1
    opts = {p: _awq_opts(plan) for p, plan in planned.items()}
    keep = max(1, -(-max(max(o.search_tokens, o.clip_tokens) for o in opts.values()) // seq))
    mods = {p: run.module(p) for p in planned}
    stats = run.collect(mods, want_hessian=False, keep_samples=keep, stop_early=False)
    starved = starved_experts(arch, planned, stats, planned)  # plain round-to-nearest for these
    for p, why in starved.items() if clip else ():  # (awq+gptq: GPTQ logs its own fallback)
        log.warning("%s: %s; using round-to-nearest", planned[p].name, why)
        info.setdefault("rtn_fallback", {})[planned[p].name] = why
    for m in arch.smooth:
        cons = [p for p in m.linears if p in planned]
        if not cons or any(not stats[p].reached or p in starved for p in cons):
            continue
        found = smooth_modules(run, m)
        if found is None:
            continue
        prev, consumers = found
        o = opts[cons[0]]
        x = _subsample(stats[cons[0]].inputs(), o.search_tokens)
        res = awq_search_scales(x, [c.weight for c in consumers], planned[cons[0]].format, n_grid=o.grid,
                                x_mean=stats[cons[0]].mean_abs, name=f"{run.prefix}.{m.prev}")
        info.setdefault("awq_alpha", {})[f"{run.prefix}.{m.prev}"] = res.alpha
        if res.alpha == 0:
            continue
        fold_scales(prev.weight.data, getattr(prev, "bias", None), [c.weight.data for c in consumers], res.scales,
                    m.prev_kind, arch.norm_plus_one)
        for p in m.linears:
            if p in stats:
                stats[p].scale_inputs(res.scales)
    out = {}
    for p, plan in planned.items():
        w = run.module(p).weight.detach()
        if clip and opts[p].clip and stats[p].reached and p not in starved and not AWQ_NO_CLIP.search(p):
            x = _subsample(stats[p].inputs(), opts[p].clip_tokens)
            w = apply_clip(w, search_clip(w, x, plan.format, n_grid=opts[p].grid), plan.format)
        out[p] = w
    return out


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    """At most n rows of x, evenly strided (deterministic)."""
    if x.shape[0] <= n:
        return x
    return x[:: -(-x.shape[0] // n)][:n]


def planned_blocks(model: nn.Module, data: torch.Tensor, by_block: dict[int, dict[str, Any]], progress: bool,
                   desc: str) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(block run, its planned layers) for each decoder block holding a planned layer; the blocks after
    the last planned one are never run."""
    with closing(iterate_blocks(model, data, progress, desc)) as runs:
        for run in runs:
            if run.index > max(by_block, default=-1):
                break
            planned = by_block.get(run.index, {})
            if planned:
                yield run, planned


def commit_outside(model: nn.Module, outside: Sequence[Any], commit: Commit, info: dict[str, Any]) -> None:
    """Round-to-nearest for the planned layers outside the decoder blocks (calibration never reaches them)."""
    for plan in outside:
        _rtn_commit(model, plan, commit, "outside the decoder blocks, calibration does not reach it", info)


def run_awq(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
            progress: bool = True) -> dict[str, Any]:
    """AWQ: scale search + folding + clipping search, then round-to-nearest, block by block."""
    _check(layers, "awq")
    data = check_calibration_data(data, "awq")
    _, arch, by_block, outside = _split_by_block(model, layers)
    info: dict[str, Any] = {}
    with closing(planned_blocks(model, data, by_block, progress, "awq")) as blocks:  # patches undone on error
        for run, planned in blocks:
            weights = awq_block(run, planned, arch, clip=True, info=info)
            for p, plan in planned.items():
                res = rtn_quantize(weights[p], plan.format, plan.name)
                run.stage(p, res.dequantize(), _committer(commit, plan.name, res))
    commit_outside(model, outside, commit, info)
    return info


# ---------------------------------------------------------------------- GPTQ
def _gptq_opts(plan: Any) -> dict[str, Any]:
    """gptq_quantize's keyword arguments from the plan's GPTQ (or awq+gptq) config."""
    return plan_config(plan, GPTQ).gptq_kwargs()


def gptq_group(weights: dict[str, torch.Tensor], stats: dict[str, InputStats], plans: dict[str, Any]
               ) -> dict[str, QuantResult | None]:
    """GPTQ for linears that share one input.  Linears with the same format and options are stacked
    along the output dimension (rows are independent given H), so one pass serves q, k and v.
    None for a linear whose input the calibration never reached."""
    out: dict[str, QuantResult | None] = {}
    batches: dict[tuple, list[str]] = {}
    for p in weights:
        if not stats[p].reached:
            out[p] = None
            continue
        fmt = parse_format(plans[p].format)
        # stacked only with linears of the same input statistics (the same H): one expert's gate and up
        key = (id(stats[p]), fmt.spec, tuple(sorted(_gptq_opts(plans[p]).items()))) \
            if fmt.granularity != "tensor" else (p,)
        batches.setdefault(key, []).append(p)
    means: dict[int, tuple[InputStats, torch.Tensor]] = {}  # one mean Hessian per distinct statistics
    for paths in batches.values():
        plan = plans[paths[0]]
        st = stats[paths[0]]
        if st.tokens < 2 * st.in_features:
            log.warning("%s: only %d calibration tokens for %d input features; GPTQ may fit the calibration text "
                        "(give more text, or raise damping)", plan.name, st.tokens, st.in_features)
        if id(st) not in means:
            means[id(st)] = (st, st.hessian_mean())
        for p in paths:  # checked one by one: an error about the stacked weight would name one layer and a fused shape
            if not all_finite(weights[p]):
                raise MethodError(f"{plans[p].name}: weight of shape {tuple(weights[p].shape)} contains NaN or inf")
        w = torch.cat([weights[p].float() for p in paths])
        names = "+".join(plans[p].name for p in paths)
        res = gptq_quantize(w, means[id(st)][1], plan.format, name=names, **_gptq_opts(plan))
        r0 = 0
        for p in paths:
            r1 = r0 + weights[p].shape[0]
            out[p] = QuantResult(res.codes[r0:r1], res.scale[r0:r1], None if res.zero is None else res.zero[r0:r1],
                                 res.fmt, dict(res.info))
            r0 = r1
    for st, h in means.values():  # the last use of these statistics: their buffers serve the next group
        st.release()
        workspace.release(h)
    return out


def _freeze_norms(run: BlockRun, arch: ArchMapping, group: tuple[str, ...], staged: set[str],
                  planned: dict[str, Any]) -> None:
    """Freeze the norm feeding `group` when every planned linear before the group is quantised: its
    input (the block input and the outputs of those linears) no longer changes in this block."""
    before = arch.linears[:min((arch.linears.index(p) for p in group if p in arch.linears), default=0)]
    if any(p in planned and p not in staged for p in before):
        return
    for m in arch.smooth:
        if m.prev_kind == "norm" and any(p in m.linears for p in group):
            try:
                run.freeze(m.prev)
            except AttributeError:
                pass


def run_gptq(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
             progress: bool = True, awq: bool = False) -> dict[str, Any]:
    """GPTQ with true-sequential order inside each block (statistics of a group of linears are taken
    after the groups before it were quantised); with `awq`, AWQ scales are folded first."""
    method = "awq+gptq" if awq else "gptq"
    _check(layers, method)
    data = check_calibration_data(data, method)
    _, arch, by_block, outside = _split_by_block(model, layers)
    info: dict[str, Any] = {"damp": {}}
    output_of = {lin: mod for mod, lin in arch.outputs}
    with ExitStack() as stack:
        stack.enter_context(workspace.active())  # Hessians and GPTQ's scratch matrices reused group to group
        # closed at once on an error or Ctrl-C: the block runner's replay patches are undone in `finally`
        blocks = stack.enter_context(closing(planned_blocks(model, data, by_block, progress, method)))
        for run, planned in blocks:
            if awq:
                awq_block(run, planned, arch, clip=False, info=info)
            staged: set[str] = set()
            for group, declared in _groups(arch, planned):
                _freeze_norms(run, arch, group, staged, planned)
                mods = {p: run.module(p) for p in group}
                # a module whose output linear is in this group, with every other planned linear of it
                # already quantised, can be replayed from that linear's recorded input for the rest of the block
                replay = tuple(p for p in group if p in output_of and run.record_budget_left(p) and all(
                    q in staged or q == p for q in planned if q.startswith(output_of[p] + ".")))
                if declared:  # linears that share one input share one Hessian (a group of experts: one per expert)
                    sets = arch.same_input(group)
                    got = run.collect({s[0]: mods[s[0]] for s in sets}, want_hessian=True, want_abs=False,
                                      record=replay)
                    stats = {p: got[s[0]] for s in sets for p in s}
                else:
                    stats = run.collect(mods, want_hessian=True, stop_early=False, want_abs=False, record=replay)
                starved = starved_experts(arch, group, stats, planned)
                results = gptq_group({p: m.weight.detach() for p, m in mods.items() if p not in starved}, stats,
                                     {p: planned[p] for p in group})
                for p in group:
                    if p in starved:
                        _rtn_commit(model, planned[p], commit, starved[p], info)
                        continue
                    plan, res = planned[p], results[p]
                    if res is None:
                        _rtn_commit(model, plan, commit, "calibration never reached this layer", info)
                        continue
                    if res.info.get("fallback"):
                        info.setdefault("rtn_fallback", {})[plan.name] = res.info["fallback"]
                    elif res.info.get("damp", plan_config(plan, GPTQ).damp) != plan_config(plan, GPTQ).damp:
                        info["damp"][plan.name] = res.info["damp"]
                    run.stage(p, res.dequantize(), _committer(commit, plan.name, res))
                    staged.add(p)
                for p in replay:
                    run.replay(output_of[p], p)
    commit_outside(model, outside, commit, info)
    return info


def run_hqq(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
            progress: bool = True) -> dict[str, Any]:
    """HQQ, layer by layer (no calibration data)."""
    from tqdm.auto import tqdm

    from fewbits.methods.hqq import hqq_quantize

    _check(layers, "hqq")
    for plan in tqdm(layers, desc="hqq", unit="layer", disable=not progress, leave=False):
        w = model.get_submodule(plan.name).weight
        cfg = plan_config(plan, HQQ)
        res = hqq_quantize(w, plan.format, name=plan.name, iters=cfg.iters, p=cfg.p, beta=cfg.beta, kappa=cfg.kappa)
        commit(plan.name, res.to_tensor(tuple(w.shape)))
    return {}


def run_awq_gptq(model: nn.Module, layers: Sequence[Any], data: torch.Tensor | None, commit: Commit,
                 progress: bool = True) -> dict[str, Any]:
    """AWQ scales folded into the model, then GPTQ on the scaled weights."""
    return run_gptq(model, layers, data, commit, progress, awq=True)
