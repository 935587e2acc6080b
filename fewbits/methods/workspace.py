"""Scratch matrices reused across the layers of one calibration run.

A calibrated method makes the same few large temporaries for every layer: the float32 Hessian partial
sums, their mean, the permuted Hessian and its inverse factor, GPTQ's transposed weight and codes.  Fresh
from the allocator, a matrix of several MB is fresh pages from the kernel, faulted in and zeroed on
first touch: a SmolLM2 GPTQ took ~0.9 M page faults a run, 0.8-1.1 s of system time, and ran 0.5 s
faster when the C allocator was told to keep freed memory (with this pool: ~0.2 s of system time).
Here a run keeps its own: inside `active()`, `empty` hands out a released matrix of the same shape and
dtype when there is one, and `release` gives one back; outside, `empty` is `torch.empty` and `release`
does nothing.

The pool belongs to the thread that opened it and is dropped when the block ends.  A released tensor
must have no other live reference (the callers release only their own locals and popped entries).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: matrices smaller than this are left to the allocator (its own free lists serve them well)
MIN_BYTES = 1 << 20

_LOCAL = threading.local()


def _pool() -> dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] | None:
    return getattr(_LOCAL, "pool", None)


@contextmanager
def active() -> Iterator[None]:
    """Reuse released scratch matrices inside the block (on this thread); nested blocks share the pool."""
    if _pool() is not None:
        yield
        return
    _LOCAL.pool = {}
    try:
        yield
    finally:
        _LOCAL.pool = None


def empty(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised contiguous tensor on `device` (default: torch's default device): on CPU, a released
    one of this shape and dtype when available; elsewhere a new one (CUDA's caching allocator already
    reuses its blocks)."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=dev)
    pool = _pool()
    if pool is not None:
        free = pool.get((shape, dtype))
        if free:
            return free.pop()
    return torch.empty(shape, dtype=dtype, device=dev)


def release(*tensors: torch.Tensor | None) -> None:
    """Give tensors made by `empty` (or any contiguous CPU tensor that owns its memory) back for reuse;
    tensors on other devices are left to their allocator.  The caller promises nothing else uses them
    afterwards."""
    pool = _pool()
    if pool is None:
        return
    for t in tensors:
        if (t is None or t.device.type != "cpu" or t._base is not None or not t.is_contiguous()
                or t.numel() * t.element_size() < MIN_BYTES):
            continue
        pool.setdefault((tuple(t.shape), t.dtype), []).append(t)


def pooled_bytes() -> int:
    """Bytes currently held for reuse on this thread (0 outside `active`)."""
    pool = _pool() or {}
    return sum(t.numel() * t.element_size() for ts in pool.values() for t in ts)
