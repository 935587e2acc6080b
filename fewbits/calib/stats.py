"""Statistics of linear-layer inputs, collected with forward pre-hooks (no graph tracing).

For every watched linear: the Hessian proxy H = sum_t x_t x_t^T (GPTQ), the per-channel abs-max
(SmoothQuant, outlier detection) and mean |x| (AWQ), the token count, and optionally a bounded sample
of the inputs themselves (AWQ searches, layer-error measurements), keyed by calibration-sample index so
that the same tokens are kept whether samples are split across processes or not.  A forward pass runs a
batch of samples (`fewbits.calib.runner.sample_batches`); hooks are told which.

Sums are accumulated in float64 and all-reduced across processes when torch.distributed is initialised
(`reduce`), so every rank ends with the statistics of all samples.  The Hessian's products are summed
in float32 first, inside the matrix product (`addmm_`), in HESSIAN_CHUNKS partial sums: sample i goes to
partial i mod HESSIAN_CHUNKS (a batch holds samples of one class).  With 1 or 2 processes (sample i
runs on rank i mod world size) every partial holds the same samples in the same order wherever it is
computed, and the float64 total is the same.  (One float64 addition per sample instead cost a memory
pass over the matrix per sample: 1.1 s of a SmolLM2 GPTQ.)

Inputs that arrive in bfloat16 are exact in bfloat16, so their products are taken on oneDNN's bfloat16
path (`bf16_products`: float32 in and out, the products exact, the sums in float32), which on CPUs with
AMX runs ~3x faster than a float32 GEMM, or on CUDA in TF32; other dtypes use the float32 GEMM.

Everything stays on the device the inputs arrive on (the model's); the mean Hessian is plain torch
there, or compiled for CPU tensors (`mean_of_partials`, `fewbits.methods.backend`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from fewbits.calib import distributed as dist_util
from fewbits.formats.quant import all_finite
from fewbits.methods import workspace
from fewbits.methods.backend import choose as choose_backend

HESSIAN_CHUNKS = 2


@contextmanager
def bf16_products(enabled: bool = True, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, float32 matrix products whose operands are all exact in bfloat16 may run on
    a lower-precision path that keeps them exact: oneDNN's bfloat16 on CPU (products exact, sums in
    float32; AMX where the CPU has it), TF32 on CUDA (its 10-bit mantissa holds bfloat16's 7; sums in
    float32).  Only for operands known to be bfloat16 values: others would be rounded.  The backend flag
    is restored when the block ends."""
    flags = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul
    old = flags.fp32_precision
    if enabled:
        flags.fp32_precision = "tf32" if device_type == "cuda" else "bf16"
    try:
        yield
    finally:
        flags.fp32_precision = old


def mean_of_partials(parts: list[torch.Tensor], tokens: int, backend: str | None = None) -> torch.Tensor:
    """float32(((p0 + p1) + ...) / tokens) of float32 matrices, the sum in float64 in list order.

    Plain torch on the partials' device; for CPU tensors `fewbits.calib.hessian_numba` does the same in
    one pass (the same bits), chosen by `fewbits.methods.backend` (`backend`: torch, numba or auto)."""
    if choose_backend(parts[0].device, backend) == "numba":
        from fewbits.calib.hessian_numba import mean_of_partials_compiled

        return mean_of_partials_compiled(parts, tokens)
    total = parts[0].double()
    for p in parts[1:]:
        total += p  # float64 + float32, in float64
    return total.div_(tokens).float()


class CalibrationError(ValueError):
    """Calibration data that cannot be used (NaN activations, too little text)."""


class StopForward(Exception):
    """Raised by a hook to cut a forward pass short once everything wanted has been seen."""


@dataclass
class InputStats:
    """Statistics of one linear's input over the calibration tokens."""

    name: str
    in_features: int
    want_hessian: bool = True
    keep_samples: int = 0  # keep the inputs of calibration samples with index < keep_samples
    hessian: torch.Tensor | None = None  # (in, in) float64 sum of x x^T (of the partials folded so far)
    partial: dict[int, torch.Tensor] = field(default_factory=dict)  # i mod HESSIAN_CHUNKS -> float32 sum
    absmax: torch.Tensor | None = None  # (in,)
    abssum: torch.Tensor | None = None  # (in,) float64
    tokens: int = 0
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # sample index -> (tokens, in)
    want_abs: bool = True  # per-channel abs-max and mean |x| (AWQ, SmoothQuant); GPTQ needs only H
    device: torch.device | None = None  # where the inputs arrive (the model's device); set by `add`

    def add(self, x: torch.Tensor, samples: tuple[int, ...]) -> None:
        """Add the input x of one forward pass over the calibration samples `samples` (one class
        i mod HESSIAN_CHUNKS); x is (len(samples), tokens, in), or tokens x in when the layer saw them
        pooled (e.g. routed to an expert)."""
        x2 = x.detach().reshape(-1, x.shape[-1])
        xf = x2.float()
        self.device = x2.device
        # NaN or inf anywhere in x shows in a reduction over tokens (diag H = sum x^2, abs-max), which is
        # far cheaper to check than x itself
        check: torch.Tensor | None = None
        if self.want_hessian:
            k = samples[0] % HESSIAN_CHUNKS
            acc = self.partial.get(k)
            with bf16_products(x2.dtype == torch.bfloat16, x2.device.type):
                if acc is None:
                    n = xf.shape[1]
                    acc = self.partial[k] = torch.mm(xf.T, xf, out=workspace.empty(n, n, device=xf.device))
                else:
                    acc.addmm_(xf.T, xf)
            check = acc.diagonal()  # NaN stays in the sum: these samples' (earlier ones have been checked)
        if self.want_abs:
            am = x2.abs().amax(0).float()
            check = am if check is None else check
            self.absmax = am if self.absmax is None else torch.maximum(self.absmax, am)
            s = xf.abs().sum(0).double()
            self.abssum = s if self.abssum is None else self.abssum + s
        if not all_finite(check if check is not None else x2):
            raise CalibrationError(f"{self.name}: its input contains NaN or inf on calibration sample(s) "
                                   f"{list(samples)} (shape {tuple(x.shape)}); the model overflows or the data is bad")
        self.tokens += x2.shape[0]
        if any(s < self.keep_samples for s in samples):
            if x.dim() >= 3 and x.shape[0] == len(samples):
                for row, s in zip(x, samples, strict=True):
                    if s < self.keep_samples:
                        self.kept[s] = row.reshape(-1, x.shape[-1]).to(torch.float32, copy=True)
            else:  # tokens not separable by sample: kept under the batch's first sample
                self.kept[samples[0]] = x2.to(torch.float32, copy=True)

    @property
    def reached(self) -> bool:
        return self.tokens > 0

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abssum / max(self.tokens, 1)).float()

    def fold(self) -> None:
        """Add the float32 partial sums into the float64 Hessian, in partial order."""
        for k in sorted(self.partial):
            p = self.partial.pop(k)
            if self.hessian is None:
                self.hessian = p.double()
            else:
                self.hessian.add_(p)
            workspace.release(p)

    def hessian_mean(self) -> torch.Tensor:
        """H / tokens in float32 (scale does not matter to GPTQ; this keeps the numbers moderate).

        The same numbers as `fold` then a float64 division, straight from the float32 partials when nothing
        was folded yet (`mean_of_partials`)."""
        if self.hessian is None and self.partial:
            return mean_of_partials([self.partial[k] for k in sorted(self.partial)], max(self.tokens, 1))
        self.fold()
        return (self.hessian / max(self.tokens, 1)).float()

    def release(self) -> None:
        """Drop the Hessian (its float32 partial sums go back to `fewbits.methods.workspace`): for the
        last user of these statistics."""
        for k in sorted(self.partial):
            workspace.release(self.partial.pop(k))
        self.hessian = None

    def inputs(self) -> torch.Tensor:
        """Kept inputs of all processes, in sample order: (tokens, in)."""
        if not self.kept:
            return torch.zeros(0, self.in_features, device=self.device)
        return torch.cat([self.kept[k] for k in sorted(self.kept)])

    def scale_inputs(self, s: torch.Tensor) -> None:
        """Record that the input is now x / s (after folding smoothing scales into the producer)."""
        s = s.float()
        self.kept = {k: v / s for k, v in self.kept.items()}
        if self.absmax is not None:
            self.absmax = self.absmax / s
        if self.abssum is not None:
            self.abssum = self.abssum / s.double()
        self.fold()
        if self.hessian is not None:
            sd = s.double()
            self.hessian = self.hessian / sd[:, None] / sd[None, :]


def reduce(stats: Iterable[InputStats]) -> None:
    """Sum (max for abs-max) every statistic over all processes; gather kept inputs.  No-op alone.
    A rank that never saw a layer's input contributes zeros on the device of the others' statistics
    (`device`, default CPU: the collective moves tensors to its own device and back)."""
    if not dist_util.active():
        return
    for st in stats:
        st.fold()
        dev = st.device if st.device is not None else torch.device("cpu")
        st.tokens = int(dist_util.all_reduce_sum(torch.tensor([st.tokens], dtype=torch.float64, device=dev)).item())
        if st.hessian is None and st.want_hessian:
            st.hessian = torch.zeros(st.in_features, st.in_features, dtype=torch.float64, device=dev)
        if st.hessian is not None:
            st.hessian = dist_util.all_reduce_sum(st.hessian)
        if st.want_abs:
            st.absmax = dist_util.all_reduce_max(
                st.absmax if st.absmax is not None else torch.zeros(st.in_features, device=dev))
            st.abssum = dist_util.all_reduce_sum(
                st.abssum if st.abssum is not None else torch.zeros(st.in_features, dtype=torch.float64, device=dev))
        if st.keep_samples:
            st.kept = dist_util.gather_dict(st.kept)


@contextmanager
def watch_inputs(
    modules: dict[str, nn.Module], batch_ref: list[tuple[int, ...]], want_hessian: bool = True, keep_samples: int = 0,
    stop_when_all_seen: bool = False, prefix: str = "", want_abs: bool = True,
):
    """Hooks on `modules` (name -> linear) that feed `InputStats`; yields {name: InputStats}.

    `batch_ref[0]` is read by the hooks as the indices of the calibration samples being run.  With
    `stop_when_all_seen`, the forward pass is cut short (StopForward) once every module has seen
    its input for the current batch: statistics of the first linears of a block need not run the rest.
    """
    stats = {n: InputStats(f"{prefix}.{n}" if prefix else n, int(m.in_features), want_hessian, keep_samples,
                           want_abs=want_abs) for n, m in modules.items()}
    seen: set[str] = set()
    current: list[tuple[int, ...] | None] = [None]

    def make_hook(name: str) -> Callable:
        def hook(mod: nn.Module, args: tuple) -> None:
            stats[name].add(args[0], batch_ref[0])
            if stop_when_all_seen:
                if current[0] != batch_ref[0]:  # a new batch: start counting again
                    seen.clear()
                    current[0] = batch_ref[0]
                seen.add(name)
                if len(seen) == len(stats):
                    seen.clear()
                    raise StopForward
        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in modules.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
