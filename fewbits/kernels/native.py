"""Hand-written C++ operators, compiled once per machine and cached on disk.

`build(name, src, fakes)` compiles `src` (a whole C++ file that registers torch operators with ``TORCH_LIBRARY``
and includes the headers it needs) with torch's `load`, for this CPU's instruction set (``-march=native``),
into ``$FEWBITS_CACHE/kernels/<name>_<hash>`` (default ``~/.cache/fewbits``), the hash covering the source,
the flags, the CPU's flags and torch's version, so a second process only loads the library.  `fakes` maps each
operator ("namespace::op") to its fake implementation (output shapes without computing), which lets a compiled
graph keep the operator as one node.  Where compiling fails (no compiler, no OpenMP) the result is False
and `why(name)` says why; callers keep a pure-torch path for that case.

The source is compiled as written: nothing is prepended.  ``<torch/extension.h>`` (which `load_inline` adds)
pulls in pybind11 and torch's whole C++ API, several times the compile time of the headers an operator needs
(``<ATen/core/Tensor.h>``, ``<torch/library.h>``, ``<ATen/Parallel.h>``, ``<ATen/ops/empty.h>``), and a cold
start pays it.

Builds of one folder are serialised by an advisory lock (`flock`) that the kernel releases when a process
dies; torch's own lock file, which a build killed half-way leaves behind and on which every later build would
wait forever, is then known to be stale and removed.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path

import torch

#: -fvisibility=hidden: a library exports only what is marked so (its C shims), so that a build whose symbols are
#: loaded globally (`build(..., shims=True)`) cannot stand in for the same functions of another build of the same
#: source (a test's portable or AVX2 variant), which the dynamic linker would otherwise bind to the first
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fvisibility=hidden"]
#: for operators whose results a test reproduces bit for bit (no reassociation, no reciprocal rewrites)
EXACT_CFLAGS = [f for f in CFLAGS if f != "-ffast-math"]

log = logging.getLogger("fewbits.kernels")

BUILD_LOCK = "fewbits-build.lock"  # held (flock) around a build: a process that dies releases it

#: C++ any operator's source may take in by a ``@SCRATCH@`` line (`build` puts it there): `Scratch<T, SLOT>(n)`, a
#: call's temporary buffer of n T's, not zeroed.  Up to SCRATCH_KEEP bytes it is this thread's buffer for SLOT,
#: kept from call to call, larger ones its own.  A SmolLM2 step makes ~120 calls, each of which had allocated,
#: zero-filled and freed a few kB (a head's 200 kB): libc's allocator and memset fell from 9.4% to 6.0% of the
#: int8 step's main-thread samples (perf, batch 1), ``int8_mm`` at one row of int8 1.09-1.17x; ``q4_mm``'s, 7.3% to
#: 5.9% of the int4-g64 step's (the operator alone unchanged within noise, 0.93-1.05x).  Each SLOT is one of
#: a call's buffers; the operators do not call each other and copy their results out, so no two live buffers share
#: a slot.
SCRATCH_SRC = r"""
constexpr int64_t SCRATCH_KEEP = 4 << 20;
template <typename T, int SLOT>
class Scratch {
 public:
  explicit Scratch(int64_t n) : n_(n) {
    thread_local std::vector<T> kept;
    if (n * int64_t(sizeof(T)) <= SCRATCH_KEEP) {
      if (int64_t(kept.size()) < n) kept.resize(n);
      p_ = kept.data();
    } else {
      own_.resize(n);
      p_ = own_.data();
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch(Scratch&&) = default;  // own_'s buffer moves with it, so p_ stays valid
  T* data() const { return p_; }
  size_t size() const { return size_t(n_); }
  T& operator[](int64_t i) const { return p_[i]; }

 private:
  std::vector<T> own_;
  T* p_;
  int64_t n_;
};
"""

_BUILT: dict[str, bool] = {}
_WHY: dict[str, str] = {}
#: operator -> declarations of its C shim, for inductor's C++ wrapper (`c_shims`)
_SHIMS: dict[object, list[str]] = {}

#: the C type a shim takes for each schema type (what inductor's C++ wrapper passes: a tensor's handle, a pointer
#: to one or nullptr for an optional tensor, bool as 0 / 1), and how the shim hands it to the C++ function
_SHIM_TYPES = {"Tensor": ("AtenTensorHandle", "fbshim::T({})"),
               "Optional[Tensor]": ("AtenTensorHandle*", "fbshim::O({})"),
               "int": ("int64_t", "{}"), "float": ("double", "{}"), "bool": ("int32_t", "{} != 0")}
_SHIM_HEAD = r"""
#include <torch/csrc/inductor/aoti_torch/utils.h>
namespace fbshim {
inline at::Tensor& T(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }
inline std::optional<at::Tensor> O(AtenTensorHandle* h) {
  return h ? std::optional<at::Tensor>(T(*h)) : std::nullopt;
}
}  // namespace fbshim
"""


def shim_source(src: str, ops: list[str]) -> tuple[str, dict[str, str]]:
    """C shims for operators `ops` ("namespace::op") of `src`: extern "C" functions ``aoti_torch_cpu_<op>`` that
    take the handles and values inductor's C++ wrapper passes and call the operator's C++ function directly (the
    function ``m.impl`` registers for it, ``&<op>``), where without them each call goes through
    ``aoti_torch_call_dispatcher``: a lookup by name, a new handle per tensor, a boxed stack and autograd's
    fallback (~0.5 us a call, 151 calls a SmolLM2 step).  Returns the code to append and each shimmed operator's
    declaration; an operator whose schema has a type outside `_SHIM_TYPES`, returns more than one tensor or is
    registered under another function keeps the dispatcher."""
    defs = {}
    for m in re.finditer(r'm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)', src):
        text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
        defs[text.split("(", 1)[0]] = text
    code, decls = [_SHIM_HEAD], {}
    for qual in ops:
        op = qual.split("::")[-1]
        if op not in defs or not re.search(rf'm\.impl\("{op}",\s*c10::DispatchKey::CPU,\s*&{op}\)', src):
            continue
        schema = torch._C.parse_schema(f"x::{defs[op]}")
        types = [str(a.type) for a in schema.arguments]
        rets = [str(r.type) for r in schema.returns]
        if any(t not in _SHIM_TYPES for t in types) or rets not in ([], ["Tensor"]):
            continue
        # one output slot either way: a tensor's handle is written to it; for no result the wrapper passes nullptr
        params = [f"{_SHIM_TYPES[t][0]} a{i}" for i, t in enumerate(types)] + ["AtenTensorHandle* ret0"]
        call = f"{op}({', '.join(_SHIM_TYPES[t][1].format(f'a{i}') for i, t in enumerate(types))})"
        decl = f"AOTITorchError aoti_torch_cpu_{op}({', '.join(params)})"
        body = f"*ret0 = torch::aot_inductor::new_tensor_handle({call});" if rets else f"{call};"
        code.append(f'extern "C" __attribute__((visibility("default"))) {decl} {{\n'
                    f"  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({{ {body} }});\n}}\n")
        decls[qual] = decl
    return "".join(code), decls


def shims_supported() -> bool:
    """Whether this torch takes C shims for custom operators (inductor's ``aot_inductor.custom_ops_to_c_shims``)
    and ships the header they are written against; an older one keeps calling them through the dispatcher."""
    import torch._inductor.config as icfg
    from torch.utils.cpp_extension import include_paths

    return hasattr(icfg.aot_inductor, "custom_ops_to_c_shims") and any(
        (Path(p) / "torch/csrc/inductor/aoti_torch/utils.h").is_file() for p in include_paths())


def c_shims() -> dict[object, list[str]]:
    """The C shims of the operators built in this process (`build(..., shims=True)`), as inductor's
    ``aot_inductor.custom_ops_to_c_shims`` takes them: a compiled step then calls those operators directly."""
    return dict(_SHIMS)


def cpu_flags() -> str:
    """This CPU's feature flags (the code is built for its instruction set)."""
    try:
        return next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build_dir(name: str, src: str, cflags: list[str] | None = None) -> Path:
    """The directory `name`'s library is built into: one per source, flags, CPU and torch version."""
    flags = " ".join(CFLAGS if cflags is None else cflags)
    key = hashlib.sha256((src + flags + cpu_flags() + torch.__version__).encode()).hexdigest()[:16]
    base = Path(os.environ.get("FEWBITS_CACHE") or Path.home() / ".cache" / "fewbits")
    return base / "kernels" / f"{name}_{key}"


def build(name: str, src: str, fakes: dict[str, Callable[..., torch.Tensor | None]],
          cflags: list[str] | None = None, shims: bool = False) -> bool:
    """Compile (or load) `src` once per process with `cflags` (default `CFLAGS`); True when its operators are
    registered.  `shims`: also give the operators of `fakes` C shims (`shim_source`, `c_shims`) and load the
    library's symbols globally, so that a compiled step's library resolves them; one build per operator name
    (the main one: another build of the same source would define the same symbols)."""
    if name not in _BUILT:  # (callers ask on every use: all the work is in here, once)
        src = src.replace("@SCRATCH@", SCRATCH_SRC)
        decls: dict[str, str] = {}
        if shims and shims_supported():
            code, decls = shim_source(src, list(fakes))
            src += code
        try:
            from torch.utils.cpp_extension import load

            flags = CFLAGS if cflags is None else cflags
            d = build_dir(name, src, flags)
            d.mkdir(parents=True, exist_ok=True)
            with open(d / BUILD_LOCK, "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)  # one build per folder; the kernel drops it if the process dies
                baton = d / "lock"  # torch's own marker: only a build killed half-way leaves it behind now
                if baton.exists():
                    log.warning("removing %s, left by a build of %s that did not finish", baton, name)
                    baton.unlink()
                path = d / f"{name}.cpp"
                if not path.is_file() or path.read_text() != src:  # an unchanged file keeps ninja's build current
                    path.write_text(src)
                load(name, [str(path)], build_directory=str(d), is_python_module=False, extra_cflags=flags)
            for op, fake in fakes.items():
                torch.library.register_fake(op)(fake)
            if decls:
                ctypes.CDLL(str(d / f"{name}.so"), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
                for qual, decl in decls.items():
                    ns, op = qual.split("::")
                    _SHIMS[getattr(getattr(torch.ops, ns), op).default] = [decl]
            _BUILT[name] = True
        except Exception as e:  # noqa: BLE001 - any build failure means: use the caller's pure-torch path
            _BUILT[name] = False
            _WHY[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _BUILT[name]


def loaded(name: str) -> bool:
    """Whether `name`'s operators are registered in this process already (never starts a build)."""
    return _BUILT.get(name, False)


def why(name: str) -> str | None:
    """Why `name` could not be built (None when it was, or was not tried)."""
    return _WHY.get(name)


def disable(name: str, reason: str) -> None:
    """Mark `name` as unavailable (tests of the fallback paths)."""
    _BUILT[name] = False
    _WHY[name] = reason
