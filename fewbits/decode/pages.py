"""A decode step's tensors moved into one block of memory backed by transparent huge pages (2 MiB).

A decode step reads every weight once, in long sequential runs; on a CPU that read is limited by memory, and the
hardware prefetchers stop at each 4 KiB page boundary (and every page costs a TLB entry).  torch allocates a
large tensor with plain ``mmap`` (4 KiB pages: Linux gives huge pages to an anonymous mapping only where it is
asked to, ``madvise(MADV_HUGEPAGE)``, under the default "madvise" setting).  `place` copies the tensors into
one private anonymous mapping, aligned to 2 MiB and advised so, and points each tensor at its copy in place
(`Tensor.set_`): the same tensor objects and values; tensors that viewed one storage view one storage (a new
one over their part of the mapping), tensors that did not share one still do not.

`StaticDecoder` places its model's weights and fused projections so on a CPU, and its cache in a mapping of its
own (the weights' block is then the same whatever cache a decoder has).  Measured on a 2-core
AVX2 EPYC VM (`benchmarks/bench_hugepages.py`, batch 1, median step in 4 KiB pages / in huge pages, arms
alternating): Llama-3.2-1B shapes (random weights, 6 rounds of 16 steps) bf16 1.089x, int4-g32+a8 1.065x; the
small packaged models within this host's noise (two runs of 8 rounds x 32 steps: SmolLM2-135M bf16 1.069x /
0.991x, int4-g32+a8 1.047x / 1.065x; Gemma-3-270M bf16 1.018x / 1.017x, int4-g32+a8 1.005x / 0.995x).  The gain
grows with the weights (the TLB's reach: 2.5 GB are 600K 4 KiB pages).  The copy costs memory only while it
runs (each old storage is freed as its tensors move, unless something else still holds it).

Not done where it cannot help or is not asked for: off Linux, where the kernel's THP setting is "never", with
``FEWBITS_HUGE_PAGES=0``; tensors off the CPU, tensors that are not plain strided ones, storages whose viewed
bytes are under `MIN_BYTES` (too small for page effects to matter) are left where they are, unless the caller asks
for every one (`StaticDecoder` does: its int4 and int8 kernels then read all their tensors through the one
block, `Placement.block`, which starts on the 2 MiB boundary, so that a tensor's offset in it does not depend on
where the kernel put the mapping: a compiled step bakes those offsets and is loaded again in later processes).
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes of an x86-64 transparent huge page
ALIGN = 64  # bytes each placed storage starts on (a cache line)
MIN_BYTES = 64 << 10  # a storage whose tensors view fewer bytes stays where it is
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

#: the mappings made here, (start address, end address, the mapping while it lives): a storage inside a live one
#: is placed already
_ARENAS: list[tuple[int, int, weakref.ref]] = []


@dataclass(frozen=True)
class Placement:
    """What `place` did: `nbytes` moved in `storages` storages (`tensors` tensors), the mapping's start address
    (0 when nothing moved) and, when nothing moved, why; `block`, a uint8 tensor over the placed bytes from
    `address` (None when nothing moved), which operators can read the placed tensors through by their offsets
    (`fewbits.kernels.arena.Bindable.bind`): the same offsets for the same tensors in any process."""

    nbytes: int = 0
    storages: int = 0
    tensors: int = 0
    address: int = 0
    why_not: str | None = None
    block: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def huge_bytes(self) -> int:
        """Bytes of the mapping that the kernel backs with huge pages now (/proc/self/smaps; 0 if unknown)."""
        return mapping_huge_bytes(self.address) if self.address else 0


def why_not_huge(huge: bool = True) -> str | None:
    """None where huge pages can be asked for here, else why not (`huge` False: placing in 4 KiB pages,
    benchmarks' other arm, is possible wherever ``madvise`` is)."""
    if os.environ.get("FEWBITS_HUGE_PAGES", "1") == "0":
        return "FEWBITS_HUGE_PAGES=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"no transparent huge pages on {sys.platform}"
    if not huge:
        return None
    try:
        setting = THP_SETTING.read_text()
    except OSError as e:
        return f"cannot read {THP_SETTING} ({e.strerror})"
    if "[never]" in setting:
        return f"transparent huge pages are off ({THP_SETTING}: never)"
    return None


def tensors_of(roots: Iterable[object]) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` (`walk`), in the order the walk first meets them.  `place` lays them out
    in that order, which for a model is the order a decode step reads its layers' weights (each layer's attention,
    then its MLP, layer after layer), so that the step streams its weights upward in memory: the probe's GEMV
    passes laid out the other way round (the walk had taken the last child first) ran 2-6% slower (SmolLM2's step
    sets, bf16 / int8 / int4-g64, 1 and 8 rows of x)."""
    return [o for o in walk(roots) if isinstance(o, torch.Tensor)]


def walk(roots: Iterable[object]) -> Iterator[object]:
    """Every object reachable from `roots`, once each: modules' parameters, buffers and submodules, and the
    attributes of fewbits' own objects (kernels, fused projections, caches; not those a class names in its
    ``NOT_OWNED``, which refer to memory the object does not own) and of lists, tuples and dicts among them;
    depth-first, children in their own order (a module's parameters and submodules as registered, a list's
    items in turn)."""
    seen: set[int] = set()
    stack = list(reversed(list(roots)))
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        children: list[object] = []
        if isinstance(o, torch.Tensor):
            pass
        elif isinstance(o, torch.nn.Module):
            children = [*o._parameters.values(), *o._buffers.values(), *o._modules.values()]
            children += [v for k, v in vars(o).items() if not k.startswith("_")]
        elif isinstance(o, (list, tuple)):
            children = list(o)
        elif isinstance(o, dict):
            children = list(o.values())
        elif type(o).__module__.startswith("fewbits.") and hasattr(o, "__dict__"):
            skip = getattr(type(o), "NOT_OWNED", ())
            children = [v for k, v in vars(o).items() if k not in skip]
        stack += reversed(children)  # the first child is taken next


def _placeable(t: torch.Tensor, again: bool) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.numel() > 0
            and (again or not _in_arena(t.untyped_storage().data_ptr())))


def _in_arena(ptr: int) -> bool:
    _ARENAS[:] = [a for a in _ARENAS if a[2]() is not None]  # a freed mapping's addresses may be reused
    return any(lo <= ptr < hi for lo, hi, _ in _ARENAS)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor reads: [first, end)."""
    first = t.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return first * t.element_size(), (last + 1) * t.element_size()


def _groups(tensors: Iterable[torch.Tensor], again: bool,
            min_bytes: int = MIN_BYTES) -> list[tuple[int, int, list[torch.Tensor]]]:
    """The tensors grouped by the storage they view, each group with the span of bytes its tensors read
    (first, end), groups under `min_bytes` left out: a group moves as one block, so views stay views at the same
    distances."""
    by: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if _placeable(t, again):
            by.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    out = []
    for group in by.values():
        spans = [_extent(t) for t in group]
        first, end = min(a for a, _ in spans), max(b for _, b in spans)
        first -= first % ALIGN  # so that every tensor's new offset is a whole number of its elements
        if end - first >= min_bytes:
            out.append((first, end, group))
    return out


@torch.no_grad()
def place(roots: Iterable[object], huge: bool = True, again: bool = False, min_bytes: int = MIN_BYTES) -> Placement:
    """Move the tensors reachable from `roots` (`tensors_of`) into one mapping advised for huge pages (`huge`
    False: advised against them, the 4 KiB pages torch's own allocations get: benchmarks' other arm).  Each
    tensor keeps its identity, values, dtype, shape and strides; tensors viewing one storage view one storage
    after, at the same distances.  Tensors placed already (by an earlier call) stay where they are, unless
    `again` (benchmarks moving the same tensors back and forth); storages of which fewer than `min_bytes` are
    viewed stay too (0: every one, so that `Placement.block` covers them all)."""
    why = why_not_huge(huge)
    if why is not None:
        return Placement(why_not=why)
    groups = _groups(tensors_of(roots), again, min_bytes)
    sizes = [end - first for first, end, _ in groups]
    if sum(sizes) < HUGE:
        return Placement(why_not=f"{sum(sizes)} bytes of tensors to place, under one huge page")
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    # private and anonymous (a shared mapping is shmem, whose huge pages follow another setting), one page over
    # so that the block can start on a 2 MiB boundary
    area = mmap.mmap(-1, end + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    lo = torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr()
    start = -lo % HUGE
    for (first, _, group), n, off in zip(groups, sizes, offsets, strict=True):
        # a storage of its own for each group (each holds the mapping while it lives): tensors that did not alias
        # do not alias after (the compiler treats views of one storage as one input, which a cache written in
        # place among them would break)
        dst = torch.frombuffer(area, dtype=torch.uint8, count=n, offset=start + off)
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage(), first, (n,)))
        for t in group:
            byte = t.storage_offset() * t.element_size() - first
            t.set_(dst.untyped_storage(), byte // t.element_size(), t.size(), t.stride())
    _ARENAS.append((lo, lo + len(area), weakref.ref(area)))
    # the block starts where the placed bytes do, on the 2 MiB boundary, not where the mapping does (wherever
    # the kernel put it): a tensor's offset in it is then the same in every process, and a compiled step that
    # bakes the offsets of kernels bound to it (`fewbits.kernels.arena`) loads in the next process
    return Placement(nbytes=sum(sizes), storages=len(groups), tensors=sum(len(g) for *_, g in groups),
                     address=lo + start, block=torch.frombuffer(area, dtype=torch.uint8, count=end, offset=start))


def mapping_huge_bytes(address: int) -> int:
    """Bytes of the mapping holding `address` backed by huge pages (its ``AnonHugePages`` in
    /proc/self/smaps), 0 where that cannot be read."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms offset dev inode path
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
