"""Wall time of a calibrated quantisation on one device: a random-weight model with a built-in model's
shapes (default Llama-3-8B) built directly on the device, random calibration token ids, then
`api.quantize` with the chosen method and format, timed end to end (capture, Hessians, the method's
column loop, commits).  The time depends on shapes and on the code path, not on the weights' values, so
random weights stand in for a checkpoint that cannot travel.

Anchor (issue 18): llm-compressor's own guide puts GPTQ of Llama-3-8B at ~30 minutes on an A100.

    python benchmarks/bench_calib_device.py --device cuda                      # GPTQ int4-g128, 128 x 2048
    python benchmarks/bench_calib_device.py --device cpu --model smollm2-135m --samples 8 --seq-len 128

Prints one table row per run and, with --json, writes them.  Peak device memory is reported on CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fewbits import api
from fewbits.models.loading import random_model


def run(model_name: str, fmt: str, method: str, samples: int, seq_len: int, device: str, dtype: str,
        backend: str | None) -> dict:
    import os

    if backend:
        os.environ["FEWBITS_CALIB_BACKEND"] = backend  # a benchmark script, not a library call
    t0 = time.perf_counter()
    model = random_model(model_name, dtype=dtype, device=device)
    built = time.perf_counter() - t0
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    report = api.quantize(model, fmt, method=method, data=ids, progress=False, chooser="reference")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return {"model": model_name, "format": fmt, "method": method, "calibration": f"{samples} x {seq_len}",
            "device": device, "dtype": dtype, "backend": backend or "auto", "build_s": round(built, 1),
            "quantize_s": round(seconds, 1), "peak_device_gib": None if peak is None else round(peak, 1),
            "layers": len(report.quantized_layers), "bits_per_weight": report.bits_per_weight}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3-8b", help="built-in model whose shapes to use")
    ap.add_argument("--format", default="int4-g128")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--backend", default=None, help="FEWBITS_CALIB_BACKEND for the run (torch, numba; default auto)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    row = run(a.model, a.format, a.method, a.samples, a.seq_len, a.device, a.dtype, a.backend)
    print(" | ".join(f"{k} {v}" for k, v in row.items()))
    if a.json:
        a.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
