"""What the machine is: memory bandwidth and matmul rates measured on a device, its name and memory, and
the size of the CPU's level-2 cache.  Used by `fewbits probe` (`probe.py`)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from fewbits.bench.timing import time_call
from fewbits.generate import synchronizer


def _slices(nbytes: int, device: str | torch.device, chunk: int) -> tuple[list[torch.Tensor], Any]:
    """A buffer of `nbytes` of fp32 ones on `device` as its `chunk`-byte slices in order, and the device's sync."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    per = max(1, min(nbytes, chunk) // 4)
    return [x[i:i + per] for i in range(0, x.numel(), per)], synchronizer(device)


def memory_bandwidth(nbytes: int = 1 << 30, trials: int = 5, device: str | torch.device = "cpu",
                     chunk: int = 16 << 20) -> float:
    """Bytes/s of a read-only sum over `nbytes` on `device`: the fastest of the sums over its `chunk`-byte
    slices, read one after the other (`trials` passes over the whole buffer: one larger than the last-level
    cache is read from memory, a smaller one from that cache, see `bandwidth_curve`).  Short samples, of
    which the fastest counts, as `timing.py` takes them: on a host that other processes share, a sum over the
    whole buffer is almost never left alone for its whole length (here 1-2 GB/s in one sum of 1 GiB under
    load, against 11 GB/s in slices of 16 MiB)."""
    parts, sync = _slices(nbytes, device, chunk)
    for p in parts:  # once untimed
        p.sum()
    sync()
    best = 0.0
    for _ in range(trials):
        for p in parts:
            t0 = time.perf_counter()
            p.sum()
            sync()
            best = max(best, p.numel() * 4 / (time.perf_counter() - t0))
    return best


#: working-set sizes of the bandwidth curve, MiB (the 1 GiB point is `memory_bandwidth`'s own): finer around
#: 100-200 MiB, where the knee of a server's last-level cache lies (a working set read over and over in the same
#: order, as a decode step reads its weights, falls from cache speed to memory's within ~50% more bytes: here,
#: over a set's first passes, 40 GB/s at 96 MiB, 25 at 160 MiB, where 128 and 256 MiB alone had put 163 MiB at
#: ~43; settled, see `CURVE_PASSES`, 54-57 and 46-54)
CURVE_SIZES = tuple(n << 20 for n in (32, 48, 64, 96, 128, 160, 192, 256, 384, 512))
#: passes over each working set of the curve.  A last-level cache takes a set it is asked for again and again over
#: tens of passes, not at once: a 2-core Emerald Rapids Xeon (300 MiB of L3 shared with other machines) read
#: 128 MiB at 15-31 GB/s over its first ten passes and at 44-49 from the twelfth on, 160 MiB at 24-30 and then
#: 40-43 from the twentieth or thirtieth, 384 MiB at 27-28 throughout (scratch of session 47); the first five
#: passes alone had put 160 MiB at 26.5 GB/s, and with it predicted the int8 SmolLM2 step, which settles at ~38
#: GB/s over its 163 MB, 50% slower than it ran.  A decode re-reads its weights every step for as many steps as it
#: generates.
CURVE_PASSES = 60


def steady_bandwidth(nbytes: int, passes: int = CURVE_PASSES, device: str | torch.device = "cpu",
                     chunk: int = 16 << 20) -> float:
    """Bytes/s of the fastest of `passes` whole read-only passes over `nbytes` on `device`, each a sum over its
    `chunk`-byte slices one after the other (as a step reads its layers): the rate a working set reaches once
    the caches have taken it (`CURVE_PASSES`).  A whole pass, not its fastest slice: a step's time is its whole
    pass, and a slice of a set at the cache's knee is read at up to 20% more than the pass around it."""
    parts, sync = _slices(nbytes, device, chunk)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for p in parts:
            p.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return sum(p.numel() for p in parts) * 4 / best


def bandwidth_curve(sizes: tuple[int, ...] = CURVE_SIZES, passes: int = CURVE_PASSES,
                    device: str | torch.device = "cpu", memory: tuple[int, float] | None = None
                    ) -> tuple[tuple[float, float], ...]:
    """[(bytes, bytes/s)]: `steady_bandwidth` over a working set of each of `sizes` (a buffer that fits the
    last-level cache is read from there, faster than from memory; a decode step re-reads its weights every
    step), plus `memory` ((bytes, bytes/s) of memory itself) as the last point.  Made non-increasing in size:
    a smaller set is read at least as fast as a larger one (a dip is another process's load)."""
    pts = [(float(n), steady_bandwidth(n, passes, device)) for n in sizes]
    if memory is not None:
        pts.append((float(memory[0]), float(memory[1])))
    pts.sort()
    for i in range(len(pts) - 2, -1, -1):
        pts[i] = (pts[i][0], max(pts[i][1], pts[i + 1][1]))
    return tuple(pts)


def matmul_size(device: str | torch.device) -> int:
    """The GEMM size `matmul_rates` is measured at by default: 1024 on a CPU, 8192 on a GPU (whose L2 cache and
    launch latency a smaller product would measure instead of its arithmetic)."""
    return 1024 if torch.device(device).type == "cpu" else 8192


def matmul_rates(n: int = 1024, device: str | torch.device = "cpu",
                 only: tuple[str, ...] | None = None) -> dict[str, float]:
    """FLOP/s of an n x n x n GEMM per precision on `device` ("int8" only where torch._int_mm runs, "fp8"
    only where torch._scaled_mm multiplies E4M3 matrices: a CUDA chip of compute capability >= 8.9); `only`: just
    these precisions (e.g. ("fp32",), a second read of the machine's arithmetic in about a second)."""
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    sync = synchronizer(device)

    def rate(fn: Any) -> float:
        return 2 * n**3 / time_call(fn, min_time=0.2, rounds=3, sync=sync)

    def wanted(name: str) -> bool:
        return only is None or name in only

    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if not wanted(name):
            continue
        a = torch.randn(n, n, generator=g).to(device=device, dtype=dt)
        b = torch.randn(n, n, generator=g).to(device=device, dtype=dt)
        out[name] = rate(lambda a=a, b=b: a @ b)
    if hasattr(torch, "_int_mm") and wanted("int8"):
        a = torch.randint(-100, 100, (n, n), dtype=torch.int8, generator=g).to(device)
        b = torch.randint(-100, 100, (n, n), dtype=torch.int8, generator=g).to(device)
        try:
            out["int8"] = rate(lambda: torch._int_mm(a, b))
        except RuntimeError:
            pass
    if (torch.device(device).type == "cuda" and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
            and wanted("fp8")):
        a8 = torch.randn(n, n, generator=g).to(device=device, dtype=torch.float8_e4m3fn)
        b8 = torch.randn(n, n, generator=g).to(device=device, dtype=torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=device)
        try:
            out["fp8"] = rate(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        except RuntimeError:  # a chip without FP8 units
            pass
    return out


def device_description(device: str | torch.device) -> tuple[str, float]:
    """(name, memory bytes) of `device`: the CUDA device's own, or the CPU's and the host's memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return f"{props.name} (CUDA, torch {torch.__version__})", float(props.total_memory)
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)", float(mem_total)


def l2_cache_bytes() -> int:
    """Bytes of the level-2 cache of CPU 0 (Linux sysfs), 0 when the system does not say."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for d in sorted(base.glob("index*")) if base.is_dir() else []:
        try:
            if (d / "level").read_text().strip() != "2" or (d / "type").read_text().strip() == "Instruction":
                continue
            size = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        return int(size.rstrip("KMG")) * mult
    return 0


def memory_available(device: str | torch.device) -> float:
    """Bytes that can still be allocated on `device`: the CUDA device's free memory, or the host's
    MemAvailable (/proc/meminfo; all physical memory where the system does not say)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return float(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

