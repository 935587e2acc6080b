"""Tensors' bytes out of the CPU's caches, for `fewbits probe`'s skeleton steps (`fewbits.bench.probe.step_costs`).

A real model's decode step reads a layer's KV cache again only after the whole step's other bytes (its weights,
its other layers' caches) have passed through the core's and the last-level cache, so where those exceed the
last-level cache its cache comes from memory; the small operations between its matmuls reuse their own code and
data layer after layer, one layer's weights apart, and stay in the last-level cache.  A skeleton (16-wide linears,
a few layers) stepped alone finds its cache in the last-level cache.  Evicting exactly the skeleton's cache lines
before each timed step (``clflushopt``, or ``clflush`` where the CPU lacks it) gives it the model's cache reads
without also making its small operations start cold, which reading a buffer of the model's bytes between steps
did: SmolLM2's 6-layer skeleton, batch 1, 128 tokens, 0.31 ms a step stepped alone, 0.57 after a read of the
model's other 113 MB, 0.33 with its cache evicted; batch 8, 2048 tokens: 3.43, 4.93, 4.62 ms.

Built once per machine with the compiler the compiled path needs (`fewbits.kernels.native`), on x86 CPUs only;
elsewhere `evictor` returns None and the skeleton's steps run as they are.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

import torch

from fewbits.kernels import native
from fewbits.kvcache.format import KVFormat

NAME = "fewbits_evict"
SRC = r"""
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

// every 64-byte line of t's storage out of every level of the CPU's caches (written back first where dirty)
void evict(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "evict: a CPU tensor");
  char* p = static_cast<char*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size();
  for (int64_t i = 0; i < n; i += 64) {
#ifdef __CLFLUSHOPT__
    _mm_clflushopt(p + i);
#else
    _mm_clflush(p + i);
#endif
  }
  if (n > 0) _mm_clflush(p + n - 1);  // the last line, where the storage does not start on a line
  _mm_sfence();
}

TORCH_LIBRARY(fewbits_evict, m) {
  m.def("evict(Tensor t) -> ()");
  m.impl("evict", c10::DispatchKey::CPU, &evict);
}
"""


def available() -> bool:
    """Whether the `fewbits_evict` operator is usable (x86 CPUs with a C++ compiler; built once per machine)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return native.build(NAME, SRC, {})


def evictor(tensors: Iterable[torch.Tensor]) -> Callable[[], None] | None:
    """A callable that evicts `tensors`' bytes from the CPU's caches; None where it cannot (no tensors, a tensor
    not on the CPU, the operator not built)."""
    ts = list(tensors)
    if not ts or any(t.device.type != "cpu" for t in ts) or not available():
        return None
    op = torch.ops.fewbits_evict.evict

    def run() -> None:
        for t in ts:
            op(t)
    return run


def cache_evictor(model: torch.nn.Module, kvf: KVFormat | str, batch: int, max_len: int) -> Callable[[], None] | None:
    """An `evictor` of the KV cache of the compiled decoder `generate_static` runs for `model` at these shapes
    (built, so compiled or loaded, here); None where that runs eagerly (`why_eager`) or the decoder cannot be
    built (`generate_static` then says why and decodes eagerly: no cache of its own to evict)."""
    from fewbits.decode.generate import decoder_for
    from fewbits.decode.runner import why_eager

    if why_eager(model, next(model.parameters()).device) is not None:
        return None
    try:
        dec = decoder_for(model, kvf, batch, max_len)
    except Exception:  # noqa: BLE001 - a compiler failure: generate_static runs eagerly and logs it
        return None
    return evictor(t for layer in dec.cache for t in layer.t.values())
