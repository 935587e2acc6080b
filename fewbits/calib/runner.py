"""Layer-by-layer calibration: run the calibration text through the model one decoder block at a time.

1. `capture_block_inputs`: one pass with every block replaced by a recorder that passes its input
   through unchanged; this records block 0's input hidden states and the keyword arguments each block
   receives (masks, rotary embeddings: Gemma 3 gives sliding and global layers different ones).
   The pass stops at the last block, so no logits are ever computed.
2. For each block, a method collects statistics with hooks (`BlockRun.collect`), quantises the block's
   linears, and `BlockRun.advance` feeds the *quantised* block's outputs to the next block.  Once the
   linears up to a module's output linear are quantised, `BlockRun.replay` computes that module (attention,
   MLP: declared pairs) from the linear's recorded input for the block's remaining passes, and
   `BlockRun.freeze` keeps a norm's output once nothing before it changes (each later pass of a block
   would otherwise recompute the input norm it no longer uses and the MLP's norm it already computed).
Live memory is one block's activations for the calibration samples (plus the model itself).

Samples run in batches of about BATCH_TOKENS tokens (`sample_batches`): one batch holds samples of one
class i mod HESSIAN_CHUNKS, which is also the Hessian partial they are summed into.  With 1 or 2
processes (sample i runs on rank i mod world size) a class lives on one rank, so every batch, and with it
the arithmetic of every sample, is the same whichever process runs it; with torch.distributed each rank
runs its share and the statistics are all-reduced (other process counts agree to float rounding).
(Batches rather than single samples: a SmolLM2 block pass over 16 x 256 tokens took 77-95 ms one sample
at a time, 54-71 ms in four batches.  A SmolLM2 GPTQ, alternating runs: ~7.1 s in four batches of 1024
tokens, ~6.5 s in two of 2048; one batch of 4096 was ~0.2 s faster still, but a lone process and two no
longer agree bit for bit.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fewbits.calib import distributed as dist_util
from fewbits.calib.stats import HESSIAN_CHUNKS, CalibrationError, InputStats, StopForward, reduce, watch_inputs
from fewbits.formats.quant import all_finite
from fewbits.kernels.wide16 import widening
from fewbits.models.mappings import ArchMapping, find_blocks_path, mapping_for_config

log = logging.getLogger("fewbits.calib")

#: fewest calibration tokens a calibrated method accepts
MIN_CALIB_TOKENS = 128
#: recorded linear inputs (for replaying a module) may take at most this many times the memory of a
#: block's calibration hidden states
REPLAY_BUDGET = 4.0
#: calibration samples run through a block in batches of about this many tokens (at least one sample)
BATCH_TOKENS = 2048
#: attribute of a model whose weights are read from disk block by block (fewbits.stream): an object with
#: `capture()` (a context manager around the pass that records block 0's inputs), `enter(i)` (before block
#: i is run: its weights are read) and `leave(i)` (after block i is quantised: it is written out and freed)
BLOCK_HOOKS_ATTR = "fewbits_block_hooks"

Batch = tuple[int, ...]  # indices of the calibration samples run together


class _Recorder(nn.Module):
    """Stands in for a decoder block during capture: records its inputs and passes hidden states on."""

    def __init__(self, block: nn.Module, index: int, last: bool, store: Callable[[int, tuple, dict], None]):
        super().__init__()
        self.block = block
        self.index, self.last, self.store = index, last, store

    def __getattr__(self, name: str) -> Any:  # attributes the model loop reads (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.store(self.index, args, kwargs)
        if self.last:
            raise StopForward
        return args[0] if args else kwargs["hidden_states"]


def check_calibration_data(data: torch.Tensor | None, method: str) -> torch.Tensor:
    """(n_samples, seq_len) token ids with at least MIN_CALIB_TOKENS tokens, else CalibrationError."""
    if data is None:
        raise CalibrationError(f"method {method} needs calibration text; none was given")
    if data.dim() == 1:
        data = data.unsqueeze(0)
    n = int(data.numel())
    if n < MIN_CALIB_TOKENS or data.shape[0] < dist_util.world_size():
        raise CalibrationError(
            f"method {method}: {n} calibration tokens in {data.shape[0]} sample(s) is too little; it needs at "
            f"least {MIN_CALIB_TOKENS} tokens and one sample per process ({dist_util.world_size()}), "
            "e.g. 16 samples x 256 tokens")
    return data


def sample_batches(samples: list[int], seq_len: int) -> list[Batch]:
    """This process's samples in batches: by class i mod HESSIAN_CHUNKS, in order, at most
    max(1, BATCH_TOKENS // seq_len) samples each."""
    size = max(1, BATCH_TOKENS // max(seq_len, 1))
    out: list[Batch] = []
    for k in range(HESSIAN_CHUNKS):
        cls = [s for s in samples if s % HESSIAN_CHUNKS == k]
        out += [tuple(cls[i:i + size]) for i in range(0, len(cls), size)]
    return out


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList, ArchMapping]:
    """(full name, module list, mapping) of the model's decoder blocks, from the declared mappings."""
    arch = mapping_for_config(getattr(model, "config", None))
    names = [n for n, _ in model.named_modules()]
    path = find_blocks_path(names, arch)
    return path, model.get_submodule(path), arch


@dataclass
class BlockRun:
    """One decoder block and its calibration inputs (this process's share of the samples, in batches)."""

    index: int
    prefix: str  # full name of the block, e.g. "model.layers.3"
    block: nn.Module
    batches: list[Batch]
    hidden: list[torch.Tensor]  # per batch: (batch size, tokens, hidden)
    kwargs: list[dict[str, Any]]  # per batch
    batch_ref: list[Batch] = field(default_factory=lambda: [()])  # the batch being run (read by hooks)
    deferred: list[Callable[[], None]] = field(default_factory=list)  # run after `advance`
    recorded: dict[str, dict[Batch, torch.Tensor]] = field(default_factory=dict)  # linear -> batch -> input
    patched: list[nn.Module] = field(default_factory=list)  # modules replayed or frozen until `finish`
    # replays found exact, shared by the blocks of one run: (module path, class) -> the rest of its output
    verified: dict[tuple[str, str], tuple | None] = field(default_factory=dict)

    def stage(self, path: str, w_hat: torch.Tensor, commit: Callable[[], None]) -> None:
        """Put the quantised values `w_hat` in the float linear `path` for the rest of this block's
        passes and its outputs; `commit` (swap in the packed layer) runs once the block is done."""
        lin = self.module(path)
        lin.weight.data = w_hat.to(lin.weight.dtype)
        self.deferred.append(commit)

    def module(self, path: str) -> nn.Module:
        return self.block.get_submodule(path)

    @torch.no_grad()
    @widening
    def forward_all(self) -> None:
        """Run every batch through the block, ignoring outputs (hooks collect what they need)."""
        for i, batch in enumerate(self.batches):
            self.batch_ref[0] = batch
            try:
                self.block(self.hidden[i], **self.kwargs[i])
            except StopForward:
                pass

    def collect(self, modules: dict[str, nn.Module], want_hessian: bool = True, keep_samples: int = 0,
                stop_early: bool = True, want_abs: bool = True, record: tuple[str, ...] = ()
                ) -> dict[str, InputStats]:
        """Statistics of the inputs of `modules` (name -> linear) over all samples of all processes.

        The inputs of the linears in `record` (paths inside the block) are kept, per batch, for `replay`."""
        handles = [self.module(p).register_forward_pre_hook(self._recorder(p)) for p in record]
        try:
            with watch_inputs(modules, self.batch_ref, want_hessian, keep_samples, stop_early, self.prefix,
                              want_abs) as stats:
                self.forward_all()
        finally:
            for h in handles:
                h.remove()
        reduce(stats.values())
        return stats

    def _recorder(self, path: str) -> Callable:
        store = self.recorded.setdefault(path, {})

        def hook(mod: nn.Module, args: tuple) -> None:
            store[self.batch_ref[0]] = args[0].detach()
        return hook

    def record_budget_left(self, path: str) -> bool:
        """Whether recording the inputs of linear `path` keeps all recorded inputs within REPLAY_BUDGET
        times the memory of the block's calibration hidden states."""
        hidden = sum(h.numel() * h.element_size() for h in self.hidden)
        held = sum(t.numel() * t.element_size() for r in self.recorded.values() for t in r.values())
        tokens = sum(h.numel() // h.shape[-1] for h in self.hidden)
        need = tokens * int(self.module(path).in_features) * self.hidden[0].element_size() if self.hidden else 0
        return held + need <= REPLAY_BUDGET * hidden

    def replay(self, module_path: str, linear_path: str) -> None:
        """From now on (until the block is done) compute module `module_path` as linear `linear_path`
        applied to its recorded input, instead of running the module again.

        Valid when the module's output is that linear's output and nothing before the linear changes any
        more (the architecture mapping declares the pairs; the caller checks every other planned linear of
        the module is already quantised).  The first call runs the real module and checks that the replay
        gives the identical tensor; if not, replay is switched off for the module with a log line.  Once
        found exact, the same module path and class is not checked again in later blocks of the run (the
        check ran each attention and MLP of the block in full once: ~0.35 s of a SmolLM2 GPTQ), unless its
        output carries other tensors beside the linear's."""
        mod, lin, rec = self.module(module_path), self.module(linear_path), self.recorded[linear_path]
        key = (module_path, type(mod).__qualname__)
        state: dict[str, Any] = {"checked": key in self.verified, "rest": self.verified.get(key)}
        outputs: dict[Batch, torch.Tensor] = {}  # the linear's output per batch, computed once
        real = mod.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            s = self.batch_ref[0]
            if not state["checked"]:
                out = real(*args, **kwargs)
                first = out[0] if isinstance(out, tuple) else out
                x = rec.get(s)
                if x is not None and torch.equal(first, torch.nn.functional.linear(x, lin.weight, lin.bias)):
                    state["checked"], state["rest"] = True, (out[1:] if isinstance(out, tuple) else None)
                    if not any(isinstance(t, torch.Tensor) for t in state["rest"] or ()):
                        self.verified[key] = state["rest"]
                else:
                    log.warning("%s.%s: replaying it from %s's recorded input does not reproduce its output; "
                                "running it in full", self.prefix, module_path, linear_path)
                    del mod.forward
                    self.patched.remove(mod)
                return out
            y = outputs.get(s)
            if y is None:
                y = outputs[s] = lin(rec.pop(s))  # the input is not needed again
            y = y.clone()  # a copy: the caller may change it in place
            return y if state["rest"] is None else (y, *state["rest"])

        self._patch(mod, forward)

    def freeze(self, module_path: str) -> None:
        """From now on (until the block is done) module `module_path` returns, for each batch, a copy of
        the output it gave the first time.  Valid when nothing before the module changes any more (the
        caller's to know: a norm whose input comes only from quantised linears and the block input).
        A module that does not return a plain tensor is left alone."""
        mod = self.module(module_path)
        real = mod.forward
        cache: dict[Batch, torch.Tensor] = {}

        def forward(*args: Any, **kwargs: Any) -> Any:
            s = self.batch_ref[0]
            out = cache.get(s)
            if out is None:
                out = real(*args, **kwargs)
                if not isinstance(out, torch.Tensor):
                    return out
                cache[s] = out
            return out.clone()  # a copy: the caller may change it in place

        self._patch(mod, forward)

    def _patch(self, mod: nn.Module, forward: Callable[..., Any]) -> None:
        """Run `forward` instead of the module's own until `finish`."""
        mod.forward = forward
        self.patched.append(mod)

    def finish(self) -> None:
        """Restore replayed and frozen modules and drop recorded inputs (the block is done)."""
        for mod in self.patched:
            del mod.forward
        self.patched.clear()
        self.recorded.clear()

    @torch.no_grad()
    @widening
    def advance(self) -> list[torch.Tensor]:
        """Outputs of the (now quantised) block for every batch: the next block's inputs."""
        outs = []
        for i, batch in enumerate(self.batches):
            self.batch_ref[0] = batch
            out = self.block(self.hidden[i], **self.kwargs[i])
            out = out[0] if isinstance(out, tuple) else out
            if not all_finite(out):
                raise CalibrationError(f"{self.prefix}: output is NaN or inf on calibration sample(s) "
                                       f"{list(batch)} after quantisation")
            outs.append(out)
        return outs


@torch.no_grad()
@widening
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, data: torch.Tensor, batches: list[Batch]
                         ) -> tuple[list[torch.Tensor], list[list[dict[str, Any]]]]:
    """Block 0's input hidden states per batch, and per block the keyword arguments per batch."""
    n = len(blocks)
    hidden: list[torch.Tensor] = []
    kwargs: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def store(i: int, args: tuple, kw: dict) -> None:
        kw = dict(kw)
        h = args[0] if args else kw.pop("hidden_states")
        if i == 0:
            if not all_finite(h):
                raise CalibrationError("the embeddings of a calibration sample contain NaN or inf")
            hidden.append(h.detach())
        kwargs[i].append(kw)

    originals = list(blocks)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    for i, b in enumerate(originals):
        blocks[i] = _Recorder(b, i, i == n - 1, store)
    try:
        for batch in batches:
            try:
                model(input_ids=data[list(batch)].to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        for i, b in enumerate(originals):
            blocks[i] = b
    return hidden, kwargs


def iterate_blocks(model: nn.Module, data: torch.Tensor, progress: bool = False, desc: str = "calibrate"
                   ) -> Iterator[BlockRun]:
    """Yield a `BlockRun` per decoder block; after the caller quantised it, its outputs feed the next.

    Each block's replay and freeze patches are removed in `finally`, however the caller's loop ends (an
    error, KeyboardInterrupt, a `break`).  A generator's `finally` runs when it is closed: callers use
    `contextlib.closing` so that happens at once, not when the traceback holding the frame is dropped."""
    from tqdm.auto import tqdm

    _, blocks, _ = decoder_blocks(model)
    batches = sample_batches(dist_util.my_samples(int(data.shape[0])), int(data.shape[1]))
    hooks = getattr(model, BLOCK_HOOKS_ATTR, None)
    with hooks.capture() if hooks else nullcontext():
        hidden, kwargs = capture_block_inputs(model, blocks, data, batches)
    prefix = find_blocks_path([n for n, _ in model.named_modules()], decoder_blocks(model)[2])
    verified: dict[tuple[str, str], tuple | None] = {}
    for b in tqdm(range(len(blocks)), desc=desc, unit="block", disable=not progress, leave=False):
        if hooks:
            hooks.enter(b)
        run = BlockRun(b, f"{prefix}.{b}", blocks[b], batches, hidden, kwargs[b], verified=verified)
        try:
            yield run
            hidden = run.advance()
        finally:  # an exception, Ctrl-C or the caller closing the generator: no module keeps replaying
            run.finish()
        for fn in run.deferred:
            fn()
        if hooks:
            hooks.leave(b)
