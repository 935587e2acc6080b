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

import fcntl
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
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
          cflags: list[str] | None = None) -> bool:
    """Compile (or load) `src` once per process with `cflags` (default `CFLAGS`); True when its operators are
    registered."""
    src = src.replace("@SCRATCH@", SCRATCH_SRC)
    if name not in _BUILT:
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
