"""The machine's own figures on the CPU (the GPU's are checked in test_probe's CUDA test)."""

from __future__ import annotations

import os

from fewbits.bench.machine import (
    device_description,
    l2_cache_bytes,
    matmul_rates,
    matmul_size,
    memory_bandwidth,
)


def test_cpu_figures_are_plausible():
    assert 1e8 < memory_bandwidth(64 << 20, trials=2) < 1e13  # 0.1 GB/s .. 10 TB/s
    rates = matmul_rates(128)
    assert {"fp32", "bf16", "fp16"} <= set(rates) and all(1e6 < v < 1e15 for v in rates.values())
    name, mem = device_description("cpu")
    assert mem == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and "threads" in name
    assert "fp8" not in rates  # FP8 GEMMs are measured on CUDA devices only
    assert l2_cache_bytes() >= 0
    only = matmul_rates(128, only=("fp32",))  # the bench's second read: that precision alone
    assert set(only) == {"fp32"} and 1e6 < only["fp32"] < 1e15
    assert matmul_size("cpu") == 1024 and matmul_size("cuda") == 8192


def test_bandwidth_curve_sorted_with_memorys_point_and_non_increasing(monkeypatch):
    """A larger working set is never read faster than a smaller one: a dip at a small size is another process's
    load, raised to the next size's figure; memory's own point ends the curve."""
    from fewbits.bench import machine

    canned = {32 << 20: 40e9, 64 << 20: 45e9, 128 << 20: 30e9}
    monkeypatch.setattr(machine, "steady_bandwidth", lambda n, passes=5, device="cpu": canned[n])
    got = machine.bandwidth_curve((128 << 20, 32 << 20, 64 << 20), memory=(1 << 30, 20e9))
    assert got == ((32 << 20, 45e9), (64 << 20, 45e9), (128 << 20, 30e9), (1 << 30, 20e9))


def test_bandwidth_curve_measures_this_machine():
    """On the real machine: one measured point per size, memory's own point last and unchanged, plausible rates.
    (That a smaller set is never slower holds by construction; the canned test above checks that rule.)"""
    from fewbits.bench.machine import bandwidth_curve

    mem = memory_bandwidth(64 << 20, trials=2)
    got = bandwidth_curve((8 << 20,), passes=2, memory=(64 << 20, mem))
    assert [b for b, _ in got] == [8 << 20, 64 << 20] and got[-1][1] == mem
    assert all(1e8 < v < 1e13 for _, v in got)  # 0.1 GB/s .. 10 TB/s


def test_steady_bandwidth_is_the_fastest_whole_pass(monkeypatch):
    """The working set's bytes over the fastest of its passes, each pass timed whole (all its slices), not over the
    fastest slice: a clock that reads 0, 3 (pass 1: 3 s), 3, 5 (pass 2: 2 s), 5, 9 (pass 3: 4 s)."""
    from fewbits.bench import machine

    ticks = iter([0.0, 3.0, 3.0, 5.0, 5.0, 9.0])
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(ticks))
    assert machine.steady_bandwidth(8 << 20, passes=3, chunk=1 << 20) == (8 << 20) / 2.0
