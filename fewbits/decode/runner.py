"""The compiled static-cache decode: one `torch.compile`d graph per (model, batch, cache length, KV format).

    dec = StaticDecoder(model, kv="int8", batch=1, max_len=prompt + new)   # compiles (or loads) the step
    logits = dec.prefill(ids, mask); logits = dec.step(next_ids)            # ... one fixed graph per step

On a CPU inductor generates C++ kernels and, by default (``wrapper="cpp"``), C++ for the step itself: its
~800 kernel and operator calls are issued from one C++ function instead of a Python one.  That function is
built apart from the kernels and at -O1
(`CPU_OPTIONS`): compiled at -O3 together with them it took g++ minutes.  ``wrapper="python"`` (or
``FEWBITS_WRAPPER=python``) keeps inductor's Python wrapper.  The C++ wrapper calls fewbits' operators through
their C shims (`fewbits.kernels.native.c_shims`), not through the dispatcher (``FEWBITS_C_SHIMS=0`` keeps that,
for comparisons).  Each step then calls that compiled graph with its
input tensors, gathered once (`graph_call`), not through dynamo's bytecode.  The int4 and int8 kernels read their
tensors through the block the decoder placed the weights in (`pages.place`), by offsets (`fewbits.kernels.arena`),
so the graph takes that block once instead of ~240 tensors (SmolLM2 int4: 370 -> 128 inputs, each a handle the
C++ wrapper makes and drops every call; ``FEWBITS_BIND=0`` keeps the tensors).  On a CUDA device the
step is compiled with ``mode="reduce-overhead"``, which replays it as a CUDA graph (the cache tensors are marked
static, so the graph writes them in place).

The compiled code is cached on disk under ``$FEWBITS_CACHE/inductor`` (inductor's FX graph cache), set only
for the duration of the compilation (`compile_scope`); on a CPU the traced step is saved there as well
(`fewbits.decode.precompiled`), so a second process of the same model and shapes skips dynamo's tracing too.

Where compiling is impossible (`why_eager`: an architecture the step does not reproduce, no C++ compiler,
``FEWBITS_EAGER=1``) callers run the model's own eager forward instead and log that one reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fewbits.decode import pages, precompiled
from fewbits.decode.arch import Arch, describe, unsupported
from fewbits.decode.cache import LayerKV, make_cache, native_attention
from fewbits.decode.fuse import Fused, fuse_projections
from fewbits.decode.step import WIDEN, forward, rows_on
from fewbits.kernels import native, rows
from fewbits.kernels.wide16 import widened
from fewbits.kvcache.format import KVFormat, parse_kv_format

log = logging.getLogger("fewbits.decode")
#: a cache whose attention reads every preallocated slot is rounded up to a multiple of this (`cache_slots`)
SLOT_ROUND = 64
#: the fewest slots of a cache whose attention reads only the slots written so far (`cache_slots`)
MIN_SLOTS = 256


def cache_slots(tokens: int, fmt: KVFormat, device: torch.device | str) -> int:
    """How many slots a decoder preallocates for `tokens` tokens.  Each count is a compiled step of its own (about
    35-55 s cold for SmolLM2, `precompiled` saves it), so counts are few: where the step's attention reads only the
    slots written so far (the CPU's operators, `cache.native_attention`), the next power of two from `MIN_SLOTS`,
    so that `fewbits generate` with another prompt or -n loads a saved step instead of compiling one (with
    multiples of 64, 7 + 64 and 7 + 200 tokens were two compiles); the unused slots cost memory (under twice the
    cache's) and no time that shows (SmolLM2 int4-g64 at 144 tokens, bf16 cache, alternating: 192 slots 5.38 ms,
    256 5.40, 8192 5.47).  Elsewhere (a GPU, an fp8 cache with a window) the attention reads every slot: a multiple
    of `SLOT_ROUND`."""
    if tokens < 1:
        raise ValueError(f"a cache needs at least one slot, got {tokens} tokens")
    if native_attention(fmt, device):
        return max(MIN_SLOTS, 1 << (tokens - 1).bit_length())
    return -(-tokens // SLOT_ROUND) * SLOT_ROUND


WRAPPERS = ("cpp", "python")
#: inductor options of the CPU step per wrapper: the C++ wrapper built apart from the kernels (kernels -O3, the
#: wrapper at inductor's -O1 default for it), not as one -O3 file with them.  No size asserts: the step checked
#: every input's shape and stride once (dynamo's guards, on its first call) and its operators' outputs have the
#: shapes of their fake implementations (tests), yet the ~520 runtime checks of a SmolLM2 step cost ~0.5 ms of
#: its ~6 ms (int4-g64, batch 1, 2 threads: 6.21-6.83 -> 5.57-6.46 ms, alternating processes)
CPU_OPTIONS: dict[str, dict[str, object]] = {
    "cpp": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "size_asserts": False},
    "python": {"cpp_wrapper": False, "size_asserts": False},
}


def inductor_cache_dir() -> Path:
    """Where compiled graphs are kept between runs: $FEWBITS_CACHE/inductor (default ~/.cache/fewbits)."""
    base = os.environ.get("FEWBITS_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "fewbits") / "inductor"


#: inductor's warning when one fused kernel holds both 16-bit float types (`compile_scope` hides it)
MIXED_LOWP = "bf16 and fp16 are mixed in the scheduler node"


@contextlib.contextmanager
def compile_scope(cache_dir: Path | None = None) -> Iterator[None]:
    """Inductor's on-disk caches in `cache_dir` and room for one graph per shape, only inside the block (the
    process environment and torch's settings are restored after it).  Fused 16-bit operations round between
    operators as eager PyTorch does (`emulate_precision_casts`): without it inductor keeps fp32 across a fused
    chain, and SmolLM2's greedy tokens left the eager path's after ~20 tokens.  Inductor's note that a fused
    kernel mixes bf16 and fp16 (an fp8 cache's codes are widened through fp16 bits beside the bf16 activations)
    is not shown: it printed twice per fp8-cache compile in `fewbits bench` and `fewbits probe`, about nothing
    the user can change (that cache's compiled steps match the eager path's: `tests/decode/test_static.py`)."""
    import torch._dynamo.config as dcfg
    import torch._inductor.config as icfg
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    d = Path(cache_dir or inductor_cache_dir())
    d.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(d)), icfg.patch(fx_graph_cache=True, emulate_precision_casts=True), \
            dcfg.patch(recompile_limit=64, accumulated_recompile_limit=1024), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MIXED_LOWP, category=UserWarning)
        yield


def why_eager(model: torch.nn.Module, device: torch.device | str = "cpu") -> str | None:
    """None when the compiled static path can run `model` on `device`, else the one reason it cannot."""
    if os.environ.get("FEWBITS_EAGER") == "1":
        return "FEWBITS_EAGER=1"
    why = unsupported(model)
    if why is not None:
        return why
    return no_compiler() if torch.device(device).type == "cpu" else None


def no_compiler() -> str | None:
    """Why inductor cannot build CPU code here (no C++ compiler), or None."""
    from torch._inductor import config as icfg

    cxx = icfg.cpp.cxx[-1] if isinstance(icfg.cpp.cxx, tuple) else icfg.cpp.cxx
    if not any(shutil.which(c) for c in ([cxx] if cxx else []) + ["g++", "clang++", "c++"]):
        return "no C++ compiler (g++ / clang++) for inductor's CPU code"
    return None


def _step(model: torch.nn.Module, arch: Arch, cache: list[LayerKV], valid: torch.Tensor, ids: torch.Tensor,
          pos: torch.Tensor, slot: torch.Tensor, fused: Fused | None) -> torch.Tensor:
    """The compiled CPU step: everything it reads is an argument, so a saved compiled step holds no weights."""
    return forward(model, arch, cache, valid, ids, pos, slot, fused=fused)


def graph_call(fn: object, args: tuple) -> tuple[Callable[..., list], tuple[torch.Tensor, ...]] | None:
    """The compiled graph of a saved step (`torch.compile(...).aot_compile`) and the tensors it takes, so that a
    step can call the graph with them directly: dynamo's own bytecode gathers those ~500 tensors from `args`'
    modules and objects at every call (attribute and dictionary reads through ~1000 Python objects, which the
    step's stream of weights has pushed out of the caches by the next call: SmolLM2 int4-g64+a8, batch 1, a
    stream of steps: 5.96 -> 5.26 ms median, alternating).  Valid because every call passes the same objects
    (`StaticDecoder`: the per-step values are copied into the same tensors), as for skipping the guards.

    The tensors are read by running the step's bytecode once with the graph wrapped; the graph is then called
    with them and must give the bytecode's own output, bit for bit, or None is returned (the caller keeps the
    bytecode): the bytecode around the graph call only picks the graph's outputs (a tensor: its first; a list or
    tuple of tensors, as `fewbits.bench.gemv`'s compiled passes return: its first as many)."""
    art = getattr(fn, "_artifacts", None)
    graph = getattr(art, "compiled_fn", None)
    if graph is None:
        return None
    seen: list[tuple] = []

    def spy(*flat: object) -> object:
        seen.append(flat)
        return graph(*flat)

    try:
        probe = art.runtime_env.forward_callable(art.backend_id, spy, extra_globals=getattr(fn, "_extra_globals", None))
        out = probe(*args)
        outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else []
        if len(seen) != 1 or not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            return None
        again = graph(*seen[0])
    except Exception as exc:  # noqa: BLE001 - internals of another torch: keep calling the bytecode
        log.info("fewbits.decode: the step's graph is called through its bytecode (%s)", exc)
        return None
    if not isinstance(again, (list, tuple)) or len(again) < len(outs):
        return None
    same = all(isinstance(a, torch.Tensor) and a.shape == o.shape and a.dtype == o.dtype and torch.equal(a, o)
               for a, o in zip(again[:len(outs)], outs, strict=True))
    return (graph, seen[0]) if same else None


class StaticDecoder:
    """A preallocated cache for `batch` sequences of up to `max_len` tokens and the step over it.

    The compiled step reads the model's parameters where they are at each call: values changed in place are
    seen; replacing a parameter or module after construction is not supported (a CPU step checks dynamo's
    guards on its first call only)."""

    def __init__(self, model: torch.nn.Module, kv: KVFormat | str = "bf16", batch: int = 1, max_len: int = 256,
                 compile: bool = True, cache_dir: Path | None = None, fuse: bool = True,
                 wrapper: str | None = None) -> None:
        wrapper = wrapper or os.environ.get("FEWBITS_WRAPPER") or "cpp"
        if wrapper not in WRAPPERS:
            raise ValueError(f"wrapper must be one of {', '.join(WRAPPERS)}, got {wrapper!r}")
        self.wrapper = wrapper
        self.model = model
        self.arch = describe(model)
        p = next(model.parameters())
        self.device = p.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.fmt = parse_kv_format(kv)
        self.max_len = cache_slots(max_len, self.fmt, self.device)
        self.cache = make_cache(self.fmt, self.arch.n_layers, batch, self.arch.n_kv_heads, self.arch.head_dim,
                                self.max_len, self.dtype, self.device)
        self.max_len = self.cache[0].t[next(iter(self.cache[0].t))].shape[2]
        self.valid = torch.zeros(batch, self.max_len, dtype=torch.bool, device=self.device)
        self.batch = batch
        self.length = 0
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.compiled = compile
        self.fused = fuse_projections(model, self.arch.n_layers) if fuse else None  # q/k/v, gate/up: one matmul
        # the weights and the cache in huge pages (the step reads them all; `pages` says what it gains), in two
        # mappings: the weights' block is then the same, its size and every tensor's offset in it, whatever cache
        # this decoder (or the decoder that placed the weights first) has
        cpu, off = self.device.type == "cpu", pages.Placement(why_not=f"on {self.device.type}")
        self.placement = pages.place([model, self.fused], min_bytes=0) if cpu else off
        self.cache_placement = pages.place([self.cache], min_bytes=0) if cpu else off
        # the int4 and int8 kernels read through the weights' block by offsets (`fewbits.kernels.arena`): a compiled
        # step takes the block once instead of their ~240 tensors (SmolLM2), each a handle its C++ wrapper makes
        # and drops every call (``FEWBITS_BIND=0`` keeps the tensors, for comparisons)
        self.bound = self._bind(model) if compile else 0
        self.compile_s = 0.0
        self.direct = False
        self.graph_inputs = 0  # tensors the CPU step's graph takes a call, where it is called directly (`graph_call`)
        self._held: list[torch.Tensor] = []  # views that keep the graph's tensors referenced from C++ (`_compile_cpu`)
        self._fn = self._decode_eager
        if compile:
            from fewbits.kernels.ops import lower_cpu_ops_to_aten

            lower_cpu_ops_to_aten()
            cuda = self.device.type == "cuda"
            if cuda:
                for layer in self.cache:
                    for t in layer.t.values():
                        torch._dynamo.mark_static_address(t)
                torch._dynamo.mark_static_address(self.valid)
                self._fn = torch.compile(self._decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
                self._warm(cache_dir)
            else:
                rows.available()  # (built once per machine) its argmax_rows picks a greedy token in ~10 us, not ~200
                self._compile_cpu(Path(cache_dir or inductor_cache_dir()))

    def _bind(self, model: torch.nn.Module) -> int:
        """Bind the kernels of `model` and the fused projections that can read through the placed block
        (`fewbits.kernels.arena`) to it; how many are bound (to it, or still to an earlier decoder's block over the
        same tensors)."""
        from fewbits.kernels.arena import Bindable

        kernels = [k for k in pages.walk([model, self.fused]) if isinstance(k, Bindable)]
        if self.placement.block is not None and os.environ.get("FEWBITS_BIND", "1") != "0":
            for k in kernels:
                k.bind(self.placement.block)
        return sum(k._at is not None for k in kernels)

    def _decode(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return forward(self.model, self.arch, self.cache, self.valid, ids, pos, slot, fused=self.fused)

    def _decode_eager(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        from fewbits.generate import attention_backends

        with attention_backends(self.device, decode=True):  # the eager path's step attention
            return forward(self.model, self.arch, self.cache, self.valid, ids, pos, slot, self.length + 1,
                           self.fused)

    def _compile_cpu(self, cache_dir: Path) -> None:
        """Load the saved step (`precompiled`) or trace, compile and save it; then run it once on the last slot
        (loading the generated library) and forget that write."""
        ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        slot = torch.tensor([self.max_len - 1], device=self.device)
        args = (self.model, self.arch, self.cache, self.valid, ids, self.pos, slot, self.fused)
        options = dict(CPU_OPTIONS[self.wrapper])
        shims = native.c_shims() if self.wrapper == "cpp" and os.environ.get("FEWBITS_C_SHIMS") != "0" else {}
        key = precompiled.artifact_key(self.model, {"kv": self.fmt.full_spec, "batch": self.batch,
                                                    "max_len": self.max_len, "options": options,
                                                    "c_shims": sorted(str(op) for op in shims),
                                                    "fused": self.fused is not None, "bound": self.bound,
                                                    "rows": rows_on(), "widen": [str(d) for d in WIDEN],
                                                    "kv_ops": (self.cache[0].kernel, self.cache[0].native_append)})
        path = cache_dir / "fewbits-steps" / f"{key}.bin"
        import torch._inductor.config as icfg

        t0 = time.perf_counter()
        if shims:
            options["aot_inductor.custom_ops_to_c_shims"] = shims
        with torch.no_grad(), compile_scope(cache_dir), icfg.patch(options):
            with icfg.patch(precompiled.LOAD_OPTIONS):
                fn = precompiled.load(path, globals())
            if fn is not None:
                try:
                    fn(*args)
                except RuntimeError as exc:  # its guards refused these inputs: compile afresh
                    log.warning("fewbits.decode: the saved step %s does not fit (%s); compiling it again", path.name,
                                str(exc).splitlines()[0] if str(exc) else "")
                    fn = None
            if fn is None:
                compiled = torch.compile(_step, fullgraph=True, dynamic=False)
                fn = compiled  # a torch without precompile, or a step it cannot save: inductor's FX graph cache alone
                if hasattr(compiled, "aot_compile"):
                    try:
                        fn = compiled.aot_compile((args, {}))
                    except (TypeError, AttributeError, pickle.PicklingError) as exc:
                        # e.g. guards on an object that does not pickle ("cannot pickle RootGuardManager": another
                        # decoder's compiled step held on the model, before `generate.Decoders`)
                        log.info("fewbits.decode: the step cannot be saved whole (%s); compiled without saving", exc)
                        fn = compiled
                    else:
                        precompiled.save(fn, path)
                fn(*args)
        if hasattr(fn, "disable_guard_check"):
            # Its guards (~6000: every parameter's shape, stride and dtype, the cache, the modules' attributes)
            # held for this call, and every later call passes the same objects: this model and cache, and the
            # per-step values copied into the same three tensors.  Checking them again cost ~0.5 ms a step.
            fn.disable_guard_check()
        pos = self.pos.new_zeros(self.batch, 1)
        args = (self.model, self.arch, self.cache, self.valid, ids, pos, slot, self.fused)
        with torch.no_grad():
            direct = graph_call(fn, args)
        self.compile_s = time.perf_counter() - t0
        self.valid.zero_()
        self.direct = direct is not None  # the graph called with its tensors (`graph_call`), not via the bytecode
        if direct is not None:
            graph, flat = direct
            self.graph_inputs = sum(isinstance(t, torch.Tensor) for t in flat)
            # A view of each tensor the graph takes, kept while the decoder lives: a view holds its base from C++,
            # so the C++ wrapper's handles on the ~130-490 tensors (taken and dropped every call) never drop a tensor's
            # last C++ reference, which would hand its Python object back under the GIL (perf: 111 -> 13 samples of
            # ~30k in those calls; the step by median, alternating rounds in one process on a busy AVX2 EPYC: SmolLM2
            # int4-g64 1.00-1.04x, int8 1.05x, Gemma-3 int4-g32 0.88-1.04x: about 1%, within that host's noise).
            self._held = [t.view(t.shape) for t in flat if isinstance(t, torch.Tensor)]
            call = lambda: graph(*flat)[0]  # noqa: E731
        else:
            call = lambda: fn(*args)  # noqa: E731

        def run(new_ids: torch.Tensor, new_pos: torch.Tensor, new_slot: torch.Tensor) -> torch.Tensor:
            ids.copy_(new_ids), pos.copy_(new_pos), slot.copy_(new_slot)
            return call()

        self._fn = run

    def _warm(self, cache_dir: Path | None) -> None:
        """CUDA: compile (or load) the step by running it once on the last slot (twice: CUDA graphs record on a
        later call), then forget that write."""
        ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        slot = torch.tensor([self.max_len - 1], device=self.device)
        t0 = time.perf_counter()
        with torch.no_grad(), compile_scope(cache_dir):
            for _ in range(2 if self.device.type == "cuda" else 1):  # CUDA graphs record on a later call
                self._fn(ids, self.pos, slot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_s = time.perf_counter() - t0
        self.valid.zero_()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write a (left-padded) prompt ids (B, T) into an empty cache; logits (B, V) of its last position."""
        B, T = ids.shape
        if B != self.batch:
            raise ValueError(f"decoder was built for batch {self.batch}, prompt has {B} rows")
        if T >= self.max_len:
            raise ValueError(f"prompt of {T} tokens does not fit a cache of {self.max_len}")
        mask = torch.ones_like(ids) if mask is None else mask.to(ids.device)
        self.valid.zero_()
        self.valid[:, :T] = mask.bool()
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
        with widened():  # eager: a prompt's 16-bit products in fp32 where the CPU has no fast 16-bit GEMM
            logits = forward(self.model, self.arch, self.cache, self.valid, ids, pos, None, fused=self.fused)
        self.length = T
        self.pos = pos[:, -1:].clone()
        return logits

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence, ids (B,) or (B, 1); logits (B, V) of it."""
        if self.length >= self.max_len:
            raise ValueError(f"cache of {self.max_len} tokens is full")
        slot = torch.tensor([self.length], device=self.device)
        self.pos = self.pos + 1
        logits = self._fn(ids.view(self.batch, 1), self.pos, slot)
        self.length += 1
        return logits.clone() if self.device.type == "cuda" and self.compiled else logits

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the cache as stored for the tokens written so far (the format's own accounting)."""
        from fewbits.formats.kvformat import quantized_tokens

        f, L = self.fmt, self.length
        total = 0
        for layer in self.cache:
            if f.kind == "float":
                total += sum(t[:, :, :L].numel() * t.element_size() for t in layer.t.values())
                continue
            nq = int(quantized_tokens(L, f.residual, layer.G)) if layer.ring else L
            for name, t in layer.t.items():
                rows = nq // layer.G if name in ("ks", "km") else (L - nq if name in ("rk", "rv") else nq)
                total += t[:, :, :rows].numel() * t.element_size()
        return total
