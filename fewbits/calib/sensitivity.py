"""Per-layer sensitivity: how much of the model's KL one layer adds when stored in a given format.

The truth is the KL of the model on calibration text when only that layer changes format
(`layer_kl`): one full forward pass per layer and format, 210 x candidates for SmolLM2.  The proxy used
instead (`measure`) is the second-order expansion of that KL.  With y = W x the layer's output and
dW = W_hat - W the format's error after the chosen method,

    KL(p || q) ~ 1/2 dY^T F dY,         F = E_{t ~ p}[g g^T],   g = d log p(t) / dY

(the Fisher information of the model's next-token distribution over a whole sequence Y of layer
outputs; g is the gradient of the sequence's summed log-likelihood with next tokens drawn from the
model's own distribution, independently per position, so that E[g g^T] is F without bias).  Keeping
the diagonal over (token t, output channel i) and writing the squared gradients as a per-token times a
per-channel factor, g_ti^2 ~ r_t c_i / S (r_t = sum_i g_ti^2, c_i = sum_t g_ti^2, S their total: exact
when the gradients separate so), gives per token

    s(layer, format) = 1/2 sum_i (c_i / S) dW_i H_r dW_i^T / T,     H_r = sum_t r_t x_t x_t^T

(T tokens; H_r the GPTQ Hessian with each token weighted by how much its output matters; dW the chosen
method's error, GPTQ run with the 16-bit model's plain Hessian as it is in quantisation, so GPTQ's
compensation, which cancels errors in H, is seen).  `output_fisher` takes r and c from backward passes
of FISHER_BATCH sequences.  In KL units (nats per token), so sensitivities of different layers add and
compare: what `methods.budget` needs.

Measured against the truth (benchmarks/bench_budget.py, SmolLM2-135M, GPTQ, 20 layers x 2 formats):
Spearman 0.987, every pair within 0.41-1.17x of the true KL.  `measure` also keeps two others for
comparison: "kl_weight", the weights' diagonal Fisher 1/2 sum_ij F_ij dW_ij^2 / T (SqueezeLLM's
sensitivity; exact for independent rounding errors, but GPTQ's errors are correlated on purpose:
Spearman 0.81, 1.1-49x the truth), and the plain output error tr(dW H dW^T) / out (0.57).  The
factorisation misses one case it cannot see: on RTN, layer 0's v_proj read 5x low (its error at the
first position, which every later position attends to, carries gradients of many positions at once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fewbits.calib import distributed as dist_util
from fewbits.calib.runner import check_calibration_data, decoder_blocks, iterate_blocks
from fewbits.calib.stats import CalibrationError
from fewbits.kernels.wide16 import widening
from fewbits.methods.common import check_method_format

#: the method whose codes stand in for `method` when measuring sensitivity (all per-layer maths)
PROXY_METHOD = {"rtn": "rtn", "gptq": "gptq", "awq+gptq": "gptq", "awq": "rtn", "hqq": "hqq"}
#: samples per backward pass when measuring the Fisher weights
FISHER_BATCH = 2


@dataclass
class Sensitivity:
    """Per layer (in module order) and candidate: the KL proxy and the plain output error."""

    layers: list[str]
    candidates: list[str]
    kl: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> format -> proxy KL (nats/token)
    kl_weight: dict[str, dict[str, float]] = field(default_factory=dict)  # diagonal Fisher of the weights
    output_mse: dict[str, dict[str, float]] = field(default_factory=dict)  # mean squared output error
    method: str = "rtn"
    w_hat: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (layer, format) -> W_hat, if kept
    truth: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> {format: true single-layer KL}

    def scale(self, layer: str) -> float:
        """truth / proxy of the layer's measured pair (1 where none was measured): the factor `effective`
        applies to every candidate of the layer."""
        got = self.truth.get(layer)
        if not got:
            return 1.0
        fmt, true = next(iter(got.items()))
        proxy = self.kl[layer][fmt]
        return true / proxy if proxy > 0 and true > 0 else 1.0

    def effective(self, layer: str, fmt: str) -> float:
        """The sensitivity the budget optimises: the proxy, rescaled per layer by its measured truth."""
        return self.kl[layer][fmt] * self.scale(layer)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "candidates": self.candidates, "kl": self.kl, "kl_weight": self.kl_weight,
                "output_mse": self.output_mse, "method": self.method, "truth": self.truth}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sensitivity:
        """A measurement written by `to_dict` (e.g. the "sensitivity" of a saved budget.json)."""
        return cls(list(d["layers"]), list(d["candidates"]), dict(d["kl"]), dict(d.get("kl_weight", {})),
                   dict(d.get("output_mse", {})), d.get("method", "rtn"), truth=dict(d.get("truth", {})))


def check_budget_method(method: str, candidates: Sequence[str]) -> str:
    """The per-layer method measuring sensitivity for `method`; every candidate checked for `method`."""
    if method not in PROXY_METHOD:
        raise CalibrationError(f"--budget works with methods {', '.join(PROXY_METHOD)}; not {method}")
    if dist_util.active() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CalibrationError("--budget measures sensitivity in one process; run it without torchrun")
    for c in candidates:
        check_method_format(method, c)
    return PROXY_METHOD[method]


def _fisher_batches(n: int) -> list[list[int]]:
    return [list(range(i, min(n, i + FISHER_BATCH))) for i in range(0, n, FISHER_BATCH)]


@dataclass
class Fisher:
    """Squared gradients of the summed log-likelihood at one linear's output, summed two ways:
    per output channel over tokens (c, (out,)) and per token over channels (r, (samples, seq))."""

    per_channel: torch.Tensor  # (out,) float64
    per_token: torch.Tensor  # (samples, seq) float64
    tokens: int
    weight: torch.Tensor | None = None  # (out, in) float32 sum over sequences of (d log p / d W)^2


@widening
def output_fisher(model: nn.Module, data: torch.Tensor, names: Sequence[str], seed: int = 0) -> dict[str, Fisher]:
    """Per linear in `names`: squared gradients of the summed log-likelihood with respect to its output,
    next tokens drawn from the model itself (see the module's docstring), summed per channel and per token.

    The model's parameters are left untouched (no gradients taken for them); the draws use their own
    generator (`seed`), not the process's.  Also the squared gradients of the layers' weights, summed over
    backward passes of FISHER_BATCH sequences (the diagonal of the weights' Fisher information)."""
    gen = torch.Generator().manual_seed(seed)
    n, seq = int(data.shape[0]), int(data.shape[1])
    chan: dict[str, torch.Tensor | None] = dict.fromkeys(names)
    tok = {nm: torch.zeros(n, seq, dtype=torch.float64) for nm in names}
    rows_now: list[list[int]] = [[]]
    mods = {nm: model.get_submodule(nm) for nm in names}
    wsq: dict[str, torch.Tensor] = {}

    def make(name: str) -> Callable:
        def acc(g: torch.Tensor) -> None:
            g2 = g.detach().double().pow(2)  # (b, seq, out)
            s = g2.sum((0, 1))
            chan[name] = s if chan[name] is None else chan[name] + s
            tok[name][rows_now[0]] += g2.sum(-1).cpu()

        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(acc)
        return hook

    handles = [m.register_forward_hook(make(nm)) for nm, m in mods.items()]
    req = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    try:
        for p, _, _ in req:
            p.requires_grad_(False)
            p.grad = None
        for m in mods.values():
            m.weight.requires_grad_(True)
        emb = model.get_input_embeddings()
        for rows in _fisher_batches(n):
            rows_now[0] = rows
            ids = data[rows].to(next(model.parameters()).device)
            with torch.enable_grad():
                x = emb(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=x, use_cache=False).logits.float()  # (b, seq, V)
                with torch.no_grad():
                    probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), -1)
                    drawn = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(1).to(logits.device)
                    del probs
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), drawn, reduction="sum")
                nll.backward()
            for nm, m in mods.items():
                g2w = m.weight.grad.float().pow(2)
                wsq[nm] = g2w if nm not in wsq else wsq[nm].add_(g2w)
                m.weight.grad = None
    finally:
        for h in handles:
            h.remove()
        for p, r, g in req:
            p.requires_grad_(r)
            p.grad = g
    missing = [nm for nm, s in chan.items() if s is None]
    if missing:
        raise CalibrationError(f"no gradient reached {len(missing)} layer(s) (e.g. {missing[0]}); cannot measure "
                               "their sensitivity")
    return {nm: Fisher(chan[nm].cpu(), tok[nm], n * seq, wsq[nm].cpu()) for nm in names}  # type: ignore[union-attr]


def _quantised(method: str, w: torch.Tensor, h: torch.Tensor, fmt: str, name: str) -> Any:
    """The per-layer method's QuantizedTensor of the 16-bit weight (GPTQ with the 16-bit model's Hessian)."""
    if method == "gptq":
        from fewbits.methods.gptq import gptq_quantize

        return gptq_quantize(w, h, fmt, name=name, act_order=True)
    if method == "hqq":
        from fewbits.methods.hqq import hqq_quantize

        return hqq_quantize(w, fmt, name=name)
    from fewbits.methods.rtn import rtn_quantize

    return rtn_quantize(w, fmt, name)


def _weighted_hessians(run: Any, paths: dict[str, str], fisher: dict[str, Fisher]) -> tuple[list, dict]:
    """Hooks summing H_r = sum_t r_t x_t x_t^T for each linear (r_t: its output's squared gradient at
    token t), fed by the block's own calibration passes."""
    sums: dict[str, torch.Tensor] = {}

    def make(p: str) -> Callable:
        r = fisher[paths[p]].per_token

        def hook(mod: nn.Module, args: tuple) -> None:
            x = args[0].detach().double()  # (b, seq, in)
            rows = list(run.batch_ref[0])
            xs = (x * r[rows].sqrt().to(x.device).unsqueeze(-1)).reshape(-1, x.shape[-1])
            sums[p] = xs.T @ xs if p not in sums else sums[p].addmm_(xs.T, xs)
        return hook

    return [run.module(p).register_forward_pre_hook(make(p)) for p in paths], sums


def measure(model: nn.Module, data: torch.Tensor, layers: Sequence[str], candidates: Sequence[str],
            method: str = "rtn", progress: bool = False, seed: int = 0, keep: Sequence[str] = (),
            truth_windows: int = 0) -> Sensitivity:
    """The KL proxy of every layer in `layers` (full module names, inside the decoder blocks) in every
    candidate format, with `method`'s per-layer codes (see PROXY_METHOD).  The model is not changed.
    The quantised weights of the layers in `keep` are kept (`Sensitivity.w_hat`), to check against `layer_kl`.

    Three proxies are kept (`Sensitivity`): "kl" (the one used: the output's squared gradients as a
    per-token times a per-channel factor, the input statistics weighted per token), "kl_weight" (the
    weights' diagonal Fisher) and the plain output error.

    truth_windows > 0: each layer's proxy is also checked against the truth once, `layer_kl` on the
    first `truth_windows` calibration samples in the candidate the proxy finds most damaging (the
    loudest signal), and `Sensitivity.effective` rescales all of the layer's candidates by truth/proxy
    (the proxy's error is mostly a factor per layer, the same across formats: see `calibrate`)."""
    proxy = check_budget_method(method, candidates)
    data = check_calibration_data(data, "budget")
    prefix, _, _ = decoder_blocks(model)
    outside = [n for n in layers if not n.startswith(prefix + ".")]
    if outside:
        raise CalibrationError(f"--budget measures layers inside the decoder blocks only; {outside[0]} is outside "
                               f"{prefix} (leave it out of the recipe, or give it its own format)")
    fisher = output_fisher(model, data, layers, seed)
    by_block: dict[int, list[str]] = {}
    for n in layers:
        by_block.setdefault(int(n[len(prefix) + 1:].split(".")[0]), []).append(n)
    out = Sensitivity(list(layers), list(candidates), method=method)
    loudest: dict[str, Any] = {}  # layer -> (format, QuantizedTensor) of its largest proxy, for the truth
    last = max(by_block)
    with torch.no_grad():
        for run in iterate_blocks(model, data, progress, "sensitivity"):
            names = by_block.get(run.index, [])
            if names:
                paths = {n[len(run.prefix) + 1:]: n for n in names}
                handles, hr = _weighted_hessians(run, paths, fisher)
                try:
                    stats = run.collect({p: run.module(p) for p in paths}, want_hessian=True, stop_early=False,
                                        want_abs=False)
                finally:
                    for hd in handles:
                        hd.remove()
                for p, n in paths.items():
                    h = stats[p].hessian_mean()
                    w = run.module(p).weight.detach().float()
                    fi = fisher[n]
                    c = fi.per_channel
                    out.kl[n], out.kl_weight[n], out.output_mse[n] = {}, {}, {}
                    for cand in candidates:
                        qt = _quantised(proxy, w, h, cand, n)
                        w_hat = qt.dequantize()
                        if n in keep:
                            out.w_hat[(n, cand)] = w_hat
                        d = w_hat.double() - w.double()
                        e = ((d @ h.double()) * d).sum(1)  # (out,) mean squared error per output channel
                        er = ((d @ hr[p]) * d).sum(1)  # the same, tokens weighted by r_t
                        out.kl[n][cand] = float(0.5 * (c / c.sum() * er).sum() / fi.tokens)
                        out.kl_weight[n][cand] = float(0.5 * (fi.weight.double() * d * d).sum() / fi.tokens)
                        out.output_mse[n][cand] = float(e.mean())
                        if truth_windows > 0 and (n not in loudest or out.kl[n][cand] > out.kl[n][loudest[n][0]]):
                            loudest[n] = (cand, qt)  # packed: at most one candidate's bytes per layer
                    stats[p].release()
            if run.index >= last:
                break
    if truth_windows > 0:
        calibrate(model, data[:truth_windows], out, {n: (f, qt.dequantize) for n, (f, qt) in loudest.items()})
    return out


def calibrate(model: nn.Module, data: torch.Tensor, sens: Sensitivity,
              pairs: dict[str, tuple[str, Callable[[], torch.Tensor]]]) -> None:
    """Measure the true single-layer KL (`layer_kl` on `data`) of one (format, W_hat) pair per layer into
    `sens.truth`, which `Sensitivity.effective` turns into a per-layer factor on the proxy.

    Why: the proxy's factorised Fisher misjudges some layers by a factor that stays the same across
    formats (SmolLM2-135M GPTQ, 20 layers, int3-g64 and int4-g64: proxy/truth 0.41-1.17x raw; the int4
    proxy rescaled by the int3 truth 0.78-1.42x of its truth, median 1.01), and an optimiser fed the raw
    proxy favours the layers it underrates.  End to end it did not pay, though: SmolLM2 at 4.25 bits, the
    rescaled mix (truth on one 256-token window) gave 49 layers int3 and KL 0.108 on the evaluation texts
    against the raw proxy's 38 and 0.099: single-layer truths add up to less than the mix's KL, and more
    so the more layers go to 3 bits.  Hence off by default (`budgeted.TRUTH_WINDOWS`).  One forward pass
    per layer, on calibration text only."""
    ref = reference_logprobs(model, data)
    for n, (fmt, w_hat) in pairs.items():
        sens.truth[n] = {fmt: layer_kl(model, n, w_hat(), data, ref)}


@torch.no_grad()
@widening
def reference_logprobs(model: nn.Module, data: torch.Tensor) -> list[torch.Tensor]:
    """Log-probs (L, V) of the model per calibration sample: the reference `layer_kl` compares against."""
    dev = next(model.parameters()).device
    return [torch.log_softmax(model(input_ids=data[i:i + 1].to(dev), use_cache=False).logits[0].float(), -1)
            for i in range(int(data.shape[0]))]


@torch.no_grad()
@widening
def layer_kl(model: nn.Module, name: str, w_hat: torch.Tensor, data: torch.Tensor,
             ref: Sequence[torch.Tensor]) -> float:
    """The truth the proxy is checked against: mean KL(ref || model) per token on `data` when only layer
    `name` holds `w_hat`.  The layer's weight is restored afterwards."""
    lin = model.get_submodule(name)
    old = lin.weight.data
    lin.weight.data = w_hat.to(old.dtype)
    try:
        total, n = 0.0, 0
        dev = old.device
        for i, r in enumerate(ref):
            q = torch.log_softmax(model(input_ids=data[i:i + 1].to(dev), use_cache=False).logits[0].float(), -1)
            total += float((r.exp() * (r - q)).sum())
            n += r.shape[0]
    finally:
        lin.weight.data = old
    return total / n
