"""Quantised GEMV/GEMM timing at decode shapes, through the kernel dispatcher.

A weight set is a list of (out, in) shapes, e.g. every linear layer of a model once.  To time what a
decode step sees (weights streamed from memory, not from cache) the set is replicated until it holds at
least `min_bytes`, and one "pass" multiplies an input by every weight of every copy once.  The weights
are quantised on the CPU (the same codes on every device) and copied to `device`, whose dispatcher
chooses the kernels (Triton / `_scaled_mm` on a CUDA device).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fewbits.formats.format import parse_format
from fewbits.kernels import prepare_linear
from fewbits.kernels.dispatch import prepare_linear_q8
from fewbits.tensor import QuantizedTensor, quantize_tensor

_FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the projections of a decoder layer that read the same input, as `fewbits.decode.fuse.fuse_projections`
#: groups them (each group one matmul in the compiled step where its parts fuse)
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: the linear shapes (out, in) of one SmolLM2-135M block, and its (tied) LM head
SMOLLM2_BLOCK = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
SMOLLM2_HEAD = ((49152, 576),)
#: decode shapes of the GEMV benchmark: a Llama-3-8B MLP matrix and the SmolLM2 shapes
GEMV_SHAPES = ((14336, 4096), (1536, 576), (576, 1536), (576, 576), (192, 576))


@dataclass
class WeightSet:
    spec: str
    shapes: tuple[tuple[int, int], ...]
    kernels: list  # prepared kernels, copies x shapes
    nbytes: int  # bytes of one copy of the set in the format (exact, scales included)
    copies: int
    kernel_names: tuple[str, ...]

    def run(self, x_by_in: dict[int, torch.Tensor]) -> None:
        for k in self.kernels:
            k(x_by_in[k.shape[1]])

    def sampler(self, x_by_in: dict[int, torch.Tensor], per_sample: int,
                graphs: dict[str, Any] | None = None) -> Callable[[], None]:
        """A callable that runs the next `per_sample` kernels, cycling through all copies: short samples
        (many of them, so that some fall between other processes' bursts) that still read cold weights.

        `graphs` (a dict the caller keeps, shared by sets of the same calls): each sample's calls made from one
        compiled graph called directly (`compiled_calls`), as the compiled decode step makes its matmuls, not one
        Python call each; the cycle's windows of `per_sample` kernels share a graph where their calls match."""
        ks, n, state = self.kernels, len(self.kernels), [0]
        if graphs is not None:
            starts = [0]
            while (starts[-1] + per_sample) % n != 0:
                starts.append((starts[-1] + per_sample) % n)
            windows = [compiled_calls([ks[(i + j) % n] for j in range(per_sample)], x_by_in, graphs)
                       for i in starts]

            def run_compiled() -> None:
                windows[state[0]]()
                state[0] = (state[0] + 1) % len(windows)

            return run_compiled

        def run() -> None:
            i = state[0]
            for j in range(per_sample):
                k = ks[(i + j) % n]
                k(x_by_in[k.shape[1]])
            state[0] = (i + per_sample) % n

        return run

    def graph_pass(self, x_by_in: dict[int, torch.Tensor], **call: object) -> Callable[[], None]:
        """A callable that replays one pass over every copy, captured once as a CUDA graph: on a GPU the
        host launches one graph instead of a kernel per weight, so the time is the kernels' own (a GEMV of a
        few tens of MB runs in less time than the host takes to launch it).  `call` goes to every kernel
        (e.g. tiles=... for the tuner)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (compiles, allocator pools)
            for k in self.kernels:
                k(x_by_in[k.shape[1]], **call)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k in self.kernels:
                k(x_by_in[k.shape[1]], **call)
        return graph.replay


def _calls(kernels: list, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Kernel i on xs[i], in turn; every output returned (none left for the compiler to drop)."""
    outs: list[torch.Tensor] = []
    for k, x in zip(kernels, xs, strict=True):
        o = k(x)
        outs.extend(o if isinstance(o, (list, tuple)) else [o])
    return outs


def compiled_calls(kernels: list, x_by_in: dict[int, torch.Tensor], graphs: dict[str, Any]) -> Callable[[], object]:
    """`kernels`' calls (each on `x_by_in[its in-features]`) as one graph compiled as the CPU decode step is
    (inductor, its C++ wrapper: `fewbits.decode.runner.CPU_OPTIONS`) and called directly with its tensors
    (`runner.graph_call`): no Python between the calls.

    Why: a pass made from Python pays ~10 us of interpreter a call, and more around a call that streams MBs of
    weights (they evict the interpreter's own data) than around a tiny one, so a pass's time less its tiny calls'
    kept ~0.3-0.9 ms of Python a step as bytes (SmolLM2, 2-core AMX Xeon, 120 calls a step: bf16 / int8 / int4-g64
    at 1 row 8.45 / 3.58 / 2.33 ms from Python, 7.92 / 2.72 / 2.07 compiled, tiny calls 1.27-1.58 ms against
    0.20-0.38).  `graphs` keeps one compiled graph per kind of calls (`fewbits.decode.precompiled.calls_key`:
    their names, shapes and classes, their tensors' shapes, strides and dtypes, the inputs'): a set's copies, and
    the same format's sets in the next sweep, call it with their own tensors, checked bit for bit against the
    compiled function's own run on them (else they get a graph of their own).  Each is saved on disk as the
    decode step is (`$FEWBITS_CACHE/inductor/fewbits-passes`), so that the next process skips dynamo's tracing."""
    import torch._inductor.config as icfg

    from fewbits.decode import precompiled
    from fewbits.decode.runner import CPU_OPTIONS, compile_scope, graph_call, inductor_cache_dir

    xs = [x_by_in[k.shape[1]] for k in kernels]
    args = (list(kernels), xs)
    names = [f"{getattr(k, 'name', type(k).__name__)}{tuple(k.shape)}" for k in kernels]
    key = precompiled.calls_key(kernels, {"calls": names, "options": CPU_OPTIONS["cpp"],
                                          "inputs": [(tuple(x.shape), str(x.dtype)) for x in xs]})
    path = inductor_cache_dir() / "fewbits-passes" / f"{key}.bin"  # saved whole, as the step is: no tracing
    with torch.no_grad(), compile_scope(), icfg.patch(CPU_OPTIONS["cpp"]):
        fn = graphs.get(key) or _saved(path, args)
        direct = None if fn is None else graph_call(fn, args)
        if direct is None:  # none yet, or one that these calls' tensors do not fit: a graph of their own
            fn = torch.compile(_calls, fullgraph=True, dynamic=False).aot_compile((args, {}))
            precompiled.save(fn, path)
            fn(*args)
            fn.disable_guard_check()
            direct = graph_call(fn, args)
    if direct is not None:
        graphs[key] = fn
        graph, flat = direct
        return lambda: graph(*flat)
    raise RuntimeError(f"a compiled pass of {len(kernels)} calls ({names[0]}, ...) cannot be called directly")


def _saved(path: Path, args: tuple) -> Any:
    """The compiled pass saved at `path` (`compiled_calls`), once its guards took `args`; else None."""
    import torch._inductor.config as icfg

    from fewbits.decode import precompiled

    with icfg.patch(precompiled.LOAD_OPTIONS):
        fn = precompiled.load(path, globals())
    if fn is None:
        return None
    try:
        fn(*args)
    except RuntimeError:  # its guards refused these calls: compile afresh
        return None
    fn.disable_guard_check()
    return fn


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02


#: a weight set's spec ending in this (e.g. "int4-g64+a8") prepares kernels that round the activations to int8 where
#: one can (`prepare_linear_q8`, `fewbits bench --activations q8`)
A8 = "+a8"


def split_a8(spec: str) -> tuple[str, bool]:
    """(the weight format's spec, whether the kernels round the activations to int8) of a weight set's spec."""
    return spec.removesuffix(A8), spec.endswith(A8)


def _chooser(spec: str) -> Callable[[QuantizedTensor], object]:
    return prepare_linear_q8 if split_a8(spec)[1] else prepare_linear


def effective_spec(spec: str, in_features: int) -> str:
    """`spec` itself, or the same format with its group size halved until it divides in_features (a power of two
    where the format's is: the CPU operator's own group sizes; `Format.regrouped` takes the largest divisor)."""
    fmt = parse_format(split_a8(spec)[0])
    if fmt.granularity != "group" or in_features % fmt.group_size == 0:
        return fmt.spec
    g = fmt.group_size
    while g > 1 and in_features % g:
        g //= 2
    return fmt.with_group(g).spec


def build_set(spec: str, shapes: tuple[tuple[int, int], ...], min_bytes: int = 0, seed: int = 0,
              device: str | torch.device = "cpu") -> WeightSet:
    """Quantise random weights of `shapes` into `spec` (regrouping misfits) and prepare their kernels on
    `device`."""
    base = []
    nbytes = 0
    for i, shape in enumerate(shapes):
        s = effective_spec(spec, shape[1])
        w = _weight(shape, seed + i)
        if not parse_format(s).is_quantized:
            w = w.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[s])
        qt = quantize_tensor(w, s, name=f"{spec}{shape}")
        nbytes += qt.nbytes
        base.append(qt if torch.device(device).type == "cpu" else _copy(qt, device))
    copies = max(1, -(-min_bytes // max(nbytes, 1)))
    prepare = _chooser(spec)
    kernels = [prepare(qt) for qt in base]
    for _ in range(1, copies):  # independent copies so that no pass finds the weights in cache
        kernels += [prepare(_copy(qt)) for qt in base]
    names = tuple(dict.fromkeys(k.name for k in kernels))
    return WeightSet(spec, shapes, kernels, nbytes, copies, names)


class StepCall:
    """One matmul call of a decode step, made as the step makes it: a layer (`fewbits.decode.step.linear16`) or a
    fused projection (`step._fused`: its parts' outputs); a 16-bit one on `fewbits_rows::dense_mm` at few rows."""

    def __init__(self, fn: Callable[[torch.Tensor], object], shape: tuple[int, int], name: str) -> None:
        self.fn, self.shape, self.name = fn, shape, name  # fn: the layer or the `FusedLinear`

    def __call__(self, x: torch.Tensor) -> object:
        from fewbits.decode.fuse import FusedLinear
        from fewbits.decode.step import _fused, linear16

        return _fused(self.fn, x) if isinstance(self.fn, FusedLinear) else linear16(self.fn, x)


def _layer_module(spec: str, shape: tuple[int, int], seed: int, device: str | torch.device) -> torch.nn.Module:
    """A linear layer of `shape` in `spec` as a quantised model holds it: `nn.Linear` for a 16-bit format, else a
    `QuantLinear` whose kernel the dispatcher chooses (`prepare_linear`), as `fewbits bench` quantises."""
    from fewbits.models.qlinear import QuantLinear

    s = effective_spec(spec, shape[1])
    w = _weight(shape, seed)
    if not parse_format(s).is_quantized:
        lin = torch.nn.Linear(shape[1], shape[0], bias=False, device=device, dtype=_FLOAT[s])
        lin.weight.data.copy_(w.to(_FLOAT[s]))
        return lin.requires_grad_(False)
    qt = quantize_tensor(w, s, name=f"{spec}{shape}")
    return QuantLinear(qt if torch.device(device).type == "cpu" else _copy(qt, device), None, chooser=_chooser(spec))


def _module_name(m: torch.nn.Module) -> str:
    k = getattr(m, "kernel", None)
    return "dense" if k is None else getattr(k, "name", type(k).__name__)


def _module_bytes(m: torch.nn.Module) -> int:
    return int(m.weight_nbytes) if hasattr(m, "weight_nbytes") else m.weight.numel() * m.weight.element_size()


def _independent(m: torch.nn.Module) -> torch.nn.Module:
    """A copy of layer `m` whose weights (the kernel's tensors, which the calls read) are its own."""
    if not hasattr(m, "kernel"):
        return copy.deepcopy(m)
    c = copy.copy(m)  # the stored codes stay shared: only the kernel reads weights in a call
    c.kernel = copy.deepcopy(m.kernel)
    if m.codes_holder is m.kernel:  # a layer whose kernel holds its codes holds its own: every copy as the first
        c.codes_holder = c.kernel
    return c


def build_step_set(spec: str, layer: tuple[tuple[str, tuple[int, int]], ...], min_bytes: int = 0, seed: int = 0,
                   device: str | torch.device = "cpu", fuse: bool = True) -> WeightSet:
    """The matmul calls of one decoder layer as the compiled decode step makes them: `layer` is (name, (out, in))
    per linear; each layer is built as the model holds it (`_layer_module`, through the dispatcher) and, with
    `fuse`, q/k/v and gate/up are fused by `fewbits.decode.fuse.fuse_group` (one call where its rule lets the
    parts fuse, the parts' own calls where not), each called as the step calls it (`StepCall`).  Copies are whole
    layers, to at least `min_bytes`.  `shapes`
    of the result are the calls' (out, in); `kernel_names` say which kernels ran and which groups fused."""
    from fewbits.decode.fuse import fuse_group

    base = {n: _layer_module(spec, shape, seed + i, device) for i, (n, shape) in enumerate(layer)}
    nbytes = sum(_module_bytes(m) for m in base.values())
    copies = max(1, -(-min_bytes // max(nbytes, 1)))

    def one_layer(mods: dict[str, torch.nn.Module]) -> tuple[list[StepCall], list[str]]:
        calls: list[StepCall] = []
        names: list[str] = []
        done: set[str] = set()
        for n, _ in layer:
            if n in done:
                continue
            group = next((g for g in FUSE_GROUPS if n == g[0] and all(p in mods for p in g)), None) if fuse else None
            if group is not None:
                fused, _why = fuse_group([mods[p] for p in group])
                if fused is not None:
                    rows = sum(mods[p].out_features for p in group)
                    calls.append(StepCall(fused, (rows, mods[n].in_features), _module_name(mods[n])))
                    names.append(f"{_module_name(mods[n])} ({'/'.join(group)} fused)")
                    done.update(group)
                    continue
            m = mods[n]
            calls.append(StepCall(m, (m.out_features, m.in_features), _module_name(m)))
            names.append(_module_name(m))
            done.add(n)
        return calls, names

    # independent copies (deep copies of the unfused layers, each fused on its own) so that no pass finds the
    # weights in cache
    others = [{n: _independent(m) for n, m in base.items()} for _ in range(1, copies)]
    calls, names = one_layer(base)
    kernels = list(calls)
    for mods in others:
        kernels += one_layer(mods)[0]
    return WeightSet(spec, tuple(c.shape for c in calls), kernels, nbytes, copies, tuple(dict.fromkeys(names)))


def _copy(qt: QuantizedTensor, device: str | torch.device | None = None) -> QuantizedTensor:
    """An independent copy of `qt`'s stored tensors, on `device` (default: where they are)."""
    def cp(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device or t.device, copy=True)

    return replace(qt, codes=cp(qt.codes), scales=cp(qt.scales), zeros=cp(qt.zeros), tensor_scale=cp(qt.tensor_scale))


def inputs_for(shapes: tuple[tuple[int, int], ...], rows: int = 1, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, device: str | torch.device = "cpu") -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(rows, k, generator=g).to(device=device, dtype=dtype) for k in {s[1] for s in shapes}}
