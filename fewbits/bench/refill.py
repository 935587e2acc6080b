"""The core-cache refill of a decode step: the time its small operations lose when each layer's stream of weights
(and of a large batch's keys and values) has evicted their working set from the core's cache.

Measured on a skeleton model (`fewbits.bench.probe.skeleton_model`: the model's depth and heads, 16-wide linears)
whose every layer first streams x bytes of its own.  `refill_cost` does it on the eager decode path: a forward
pre-hook streams and times itself, and the step's time with the streams, less their own, less the step's
without them, is the loss.  On the compiled path no hook runs and no stream can be timed inside the step:
`CompiledRefill` compares two compiled skeletons that stream the same weights with the same matmul calls,
spread one before each layer's norm or all before the first layer.  The two paths lose very different
amounts (SmolLM2 skeleton, 2 threads, 2 MiB L2, streams of 4 MiB a layer: ~160 us a layer eager, where
thousands of Python-level operations refill, against 10-16 us compiled), which is why the compiled path
measures its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fewbits.models.spec import ModelSpec


def refill_cost(model: torch.nn.Module, spec: ModelSpec, stream_bytes: int, context: int = 128, steps: int = 8,
                rounds: int = 3, best: dict[bool, float] | None = None) -> float:
    """Seconds per layer that a batch-1 decode step of `model` (a skeleton) loses outside the streaming
    itself when every decoder layer first streams `stream_bytes` bytes of its own through the core (as a
    real model's weights or a large batch's cache do): the fastest step minus its streaming time, with
    and without the streams, in interleaved rounds, divided by the layers.  `best` ({streaming: fastest
    rest}) carries the fastest figures over calls, for rounds interleaved with other measurements."""
    from fewbits.generate import generate

    layers = list(model.model.layers)
    bufs = [torch.ones(max(stream_bytes, 4) // 4) for _ in layers]
    spent: list[float] = []  # streaming time of each forward pass
    on = [False]

    def start(_mod: Any, _args: Any) -> None:
        spent.append(0.0)

    def stream(i: int) -> Any:
        def hook(_mod: Any, _args: Any) -> None:
            if on[0]:
                t0 = time.perf_counter()
                bufs[i].sum()
                spent[-1] += time.perf_counter() - t0
        return hook

    handles = [model.register_forward_pre_hook(start)]
    handles += [layer.register_forward_pre_hook(stream(i)) for i, layer in enumerate(layers)]
    g = torch.Generator().manual_seed(1)
    best = best if best is not None else {}
    try:
        for _ in range(rounds):
            for flag in (False, True):
                on[0] = flag
                spent.clear()
                ids = torch.randint(0, spec.vocab_size, (1, context), generator=g)
                res = generate(model, ids, steps + 1, kv="bf16")
                rest = [t - s for t, s in zip(res.decode_step_s, spent[1:], strict=False)]  # spent[0]: prefill
                best[flag] = min(best.get(flag, float("inf")), *rest)
    finally:
        for h in handles:
            h.remove()
    return (best[True] - best[False]) / len(layers)


def refill_curve(x_cache: int, rests: dict[float, dict[bool, float]], n_layers: int) -> list[tuple[float, float]]:
    """[(stream bytes, refill seconds per layer)] from the fastest steps of `refill_cost` or `CompiledRefill`
    ({streaming: seconds}) per stream size (a multiple of `x_cache`), sorted by bytes, clamped at 0 and made
    non-decreasing (a longer stream evicts at least as much; a dip is noise)."""
    out: list[tuple[float, float]] = []
    top = 0.0
    for f in sorted(rests):
        r = rests[f]
        if True in r and False in r:
            top = max(top, (r[True] - r[False]) / n_layers)
            out.append((float(int(f * x_cache)), top))
    return out


class Streamed(torch.nn.Module):
    """`norm` after one-row 16-bit matmuls over weights of its own (`ws`, each (rows, width)): in a compiled step,
    the bytes a real layer's weights stream through the core's cache before the layer's small operations run.
    Each matmul's first output enters the norm's output scaled by 1e-30, so that the compiled graph keeps the
    calls while the values stay as they were."""

    def __init__(self, norm: torch.nn.Module, ws: list[torch.Tensor], x: torch.Tensor) -> None:
        super().__init__()
        self.norm = norm
        self.n = len(ws)
        for i, w in enumerate(ws):
            self.register_buffer(f"w{i}", w)
        self.register_buffer("x", x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from fewbits.decode.step import _dense

        out = self.norm(h)
        for i in range(self.n):
            w = getattr(self, f"w{i}")
            y = _dense(self.x, w, None)  # as the step makes a 16-bit matmul (`fewbits_rows::dense_mm`)
            y = F.linear(self.x, w) if y is None else y
            out = out + (y[:, :1].float() * 1e-30).to(h.dtype)
        return out


def install_streams(model: torch.nn.Module, ws: list[torch.Tensor], spread: bool) -> None:
    """Wrap every decoder layer's input norm of `model` in a `Streamed` (in place): with `spread`, layer i streams
    `ws[i]`; without, the first layer streams them all, back to back, and the others none."""
    dev = next(model.parameters()).device
    x = torch.randn(1, ws[0].shape[1], generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    for i, layer in enumerate(model.model.layers):
        mine = [ws[i]] if spread else (list(ws) if i == 0 else [])
        layer.input_layernorm = Streamed(layer.input_layernorm, mine, x)


def _stepper(model: torch.nn.Module, vocab: int, context: int, steps: int, g: torch.Generator
             ) -> Callable[[], None]:
    """One compiled decode step of `model` per call (batch 1, a 16-bit cache holding a `context`-token prompt),
    rewound to the prompt's end every `steps` steps (compiled, or loaded from disk, here)."""
    from fewbits.decode.generate import decoder_for

    dec = decoder_for(model, "bf16", 1, context + steps + 1)
    ids = torch.randint(0, vocab, (1, context), generator=g)
    with torch.no_grad():
        dec.prefill(ids)
    pos, tok = dec.pos.clone(), ids[:, -1]
    n = [0]

    def run() -> None:
        if n[0] % steps == 0:
            dec.length, dec.pos = context, pos.clone()
        n[0] += 1
        dec.step(tok)
    return run


class CompiledRefill:
    """The refill of the compiled decode step, per layer, at each of `sizes` ({key: bytes a layer streams}).

    Per size, two copies of the skeleton `make()` returns stream the same weights, one of that size per layer
    (`width` columns: the real model's hidden size, so that a stream is a real layer's one-row matmul, not a
    thin one whose output is as large as its weight), through the same matmul calls: spread, each layer before
    its own norm (its small operations then find their working set evicted, as after a real layer's linears),
    or all before the first layer (the other layers' small operations find theirs in the core's cache).  The
    steps read the same bytes with the same calls, so their difference is the refill of the layers after the
    first alone: E = (t_spread - t_front) / (L - 1), with no stream time to measure apart and subtract
    (measuring the streams in a pass of their own found them in another state of the last-level cache than
    the step did, an error as large as E itself).
    Each graph is compiled once, or loaded from disk like every compiled step."""

    def __init__(self, make: Callable[[], torch.nn.Module], sizes: dict[float, int], vocab: int, width: int,
                 context: int = 128, steps: int = 8) -> None:
        g = torch.Generator().manual_seed(1)
        self.runs: dict[float, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.n_layers = 0
        self._models: list[torch.nn.Module] = []
        for f, nbytes in sizes.items():
            pair = []
            for spread in (True, False):
                m = make()
                self.n_layers = len(m.model.layers)
                if spread:
                    dev = next(m.parameters()).device
                    rows = max(1, nbytes // (2 * width))
                    ws = [(torch.randn(rows, width, generator=g) * 0.02).to(dev, torch.bfloat16)
                          for _ in range(self.n_layers)]
                install_streams(m, ws, spread)
                pair.append(_stepper(m, vocab, context, steps, g))
                self._models.append(m)
            self.runs[f] = (pair[0], pair[1])
        self._best: dict[str, float] = {}

    def measure(self, rests: dict[float, dict[bool, float]], rounds: int = 10) -> None:
        """One measurement of every size (its two steps sampled in alternation); the fastest figures so far in
        `rests` ({size: {True: spread step, False: front step} x (L - 1) / L}, the form `refill_curve` reads,
        whose division by L then gives E)."""
        from fewbits.bench.timing import time_interleaved

        best = self._best
        for f, (spread, front) in self.runs.items():
            with torch.no_grad():
                t = time_interleaved({f"spread{f}": spread, f"front{f}": front}, min_time=0.0, rounds=rounds)
            for k, v in t.items():
                best[k] = min(v, best.get(k, v))
            scale = self.n_layers / max(self.n_layers - 1, 1)
            rests.setdefault(f, {})[True] = best[f"spread{f}"] * scale
            rests[f][False] = best[f"front{f}"] * scale
