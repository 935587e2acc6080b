"""The machine's own figures on the CPU (the GPU's are checked in test_probe's CUDA test)."""

from __future__ import annotations

import os

from fewbits.bench.machine import device_description, l2_cache_bytes, matmul_rates, memory_bandwidth


def test_cpu_figures_are_plausible():
    assert 1e8 < memory_bandwidth(64 << 20, trials=2) < 1e13  # 0.1 GB/s .. 10 TB/s
    rates = matmul_rates(128)
    assert {"fp32", "bf16", "fp16"} <= set(rates) and all(1e6 < v < 1e15 for v in rates.values())
    name, mem = device_description("cpu")
    assert mem == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and "threads" in name
    assert "fp8" not in rates  # FP8 GEMMs are measured on CUDA devices only
    assert l2_cache_bytes() >= 0
