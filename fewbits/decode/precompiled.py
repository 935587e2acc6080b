"""The compiled CPU step kept on disk whole, so that a second process skips dynamo's tracing as well.

Inductor's FX graph cache keeps the generated code, but a process that finds it still traces the model with
dynamo first (30 layers, ~5900 guards: most of the seconds of a warm start).  `torch.compile(...).aot_compile`
(torch >= 2.13, experimental) returns the traced, compiled step with its guards; `save` writes it, `load`
reads it back without tracing.

What the file holds is code, not weights: the step takes the model, its cache and the indices as arguments,
so every parameter and buffer is an input read at each call.  The file name is a hash (`artifact_key`) of
everything that shapes the graph: torch / transformers / Python versions, the CPU's vector ISA, fewbits'
decode and kernel sources (the operators' C++ included) and the model classes' sources, the model's config,
its module tree (each quantised linear's format) and every tensor's name, shape, stride and dtype, the KV
format, batch, cache length, dtype and the compile options.  A file for another layout is therefore never
found; if one is found and its guards still refuse the call, the caller compiles afresh.  The files are
pickles written by this module into the user's own cache directory, trusted as inductor's own cache is;
never a model file.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import platform
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fewbits.files import write_bytes

log = logging.getLogger("fewbits.decode")
FORMAT = 1  # bump when what is saved changes meaning
#: inductor options while loading a saved step: the vector ISA taken from the CPU's flags without a test build
#: and a child process per ISA (seconds on a busy host); its compile already passed those checks and picks the
#: same ISA.  (Precompiled headers stay as compiled: the setting is part of the libraries' hash.)
LOAD_OPTIONS: dict[str, object] = {"cpp.vec_isa_ok": True}


def _sources(classes: Iterable[type]) -> list[str]:
    """Source files whose code ends up in the graph: fewbits' decode and kernels (Python and the operators' C++),
    and those of `classes` (the model's module classes)."""
    import fewbits.decode
    import fewbits.kernels

    files = set()
    for pkg in (fewbits.decode, fewbits.kernels):
        files.update(str(p) for ext in ("*.py", "*.cpp") for p in Path(pkg.__file__).parent.glob(ext))
    for cls in set(classes):
        try:
            files.add(inspect.getsourcefile(cls) or "")
        except TypeError:  # a built-in class
            pass
    return sorted(f for f in files if f)


def _hasher(parts: Mapping[str, Any], classes: Iterable[type]) -> tuple[Any, Callable[[object], None]]:
    """A sha256 fed the versions, the CPU's vector ISA, `parts` and the sources (`_sources`), and its `add`."""
    import transformers

    h = hashlib.sha256()

    def add(x: object) -> None:
        h.update(repr(x).encode())
        h.update(b"\0")

    add((FORMAT, torch.__version__, transformers.__version__, sys.version, platform.machine(),
         torch.backends.cpu.get_cpu_capability()))
    add(json.dumps(dict(parts), sort_keys=True, default=str))
    for f in _sources(classes):
        add(f)
        h.update(Path(f).read_bytes())
    return h, add


def calls_key(calls: list, parts: Mapping[str, Any]) -> str:
    """A hash, as `artifact_key`'s, for a compiled function over `calls` (`fewbits.bench.gemv`'s step calls or
    kernels): their classes and those of every module and object they hold, and every tensor they hold's shape,
    stride and dtype, in the order a walk meets them (`fewbits.decode.pages.tensors_of`)."""
    from fewbits.decode.pages import tensors_of

    classes: set[type] = set()
    seen: set[int] = set()
    stack = list(calls)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, torch.Tensor):
            continue
        seen.add(id(o))
        classes.add(type(o))
        if isinstance(o, torch.nn.Module):
            stack += list(o.modules())[1:]
        stack += [v for v in getattr(o, "__dict__", {}).values()
                  if isinstance(v, torch.nn.Module) or type(v).__module__.startswith("fewbits.")]
    h, add = _hasher(parts, classes)
    add(sorted(f"{c.__module__}.{c.__qualname__}" for c in classes))
    for t in tensors_of(calls):
        add((tuple(t.shape), t.stride(), str(t.dtype), t.device.type))
    return h.hexdigest()[:40]


def artifact_key(model: torch.nn.Module, parts: Mapping[str, Any]) -> str:
    """A hash of everything the compiled step depends on (see the module docstring) plus `parts` (KV format,
    batch, cache length, options: JSON-serialisable values)."""
    h, add = _hasher(parts, (type(m) for m in model.modules()))
    config = getattr(model, "config", None)
    add(config.to_json_string(use_diff=False) if config is not None else None)
    add(repr(model))  # the module tree, each quantised linear's format included
    for name, m in model.named_modules():  # and the kernel each one runs (two int4 operators take one format)
        k = getattr(m, "kernel", None)
        if k is not None:
            add((name, getattr(k, "name", type(k).__name__)))
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        add((name, tuple(t.shape), t.stride(), str(t.dtype), t.device.type))
    return h.hexdigest()[:40]


def load(path: Path, f_globals: dict[str, object]) -> Callable[..., Any] | None:
    """The compiled step saved at `path`, or None when there is none or it cannot be read back (logged)."""
    if not path.is_file():
        return None
    try:
        return torch.compiler.load_compiled_function(io.BytesIO(path.read_bytes()), f_globals=f_globals)
    except Exception as exc:  # noqa: BLE001 - a stale or foreign file: compile afresh instead
        log.warning("fewbits.decode: ignoring the saved step %s (%s: %s)", path.name, type(exc).__name__, exc)
        return None


def save(fn: Any, path: Path) -> bool:
    """Write the aot-compiled `fn` to `path` (atomically); False (logged) when torch cannot serialise it."""
    try:
        data = type(fn).serialize(fn).serialized_data
    except Exception as exc:  # noqa: BLE001 - saving is an optimisation; the step itself is compiled
        log.warning("fewbits.decode: the compiled step could not be saved (%s: %s)", type(exc).__name__, exc)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, data)
    return True
