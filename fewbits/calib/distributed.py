"""Calibration across processes with torch.distributed (gloo on CPU, nccl on GPU).

Each rank runs its share of the calibration samples (sample i goes to rank i mod world_size); the
statistics are then all-reduced so that every rank quantises with the statistics of all samples and
commits identical weights.  Without an initialised process group every function is a no-op.  The library
never starts a process group (a process-wide change): `fewbits quantize` calls `init_from_env` under
torchrun, and a Python caller does the same (or `torch.distributed.init_process_group`) before quantising.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("fewbits.calib")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def init_from_env() -> bool:
    """Join the process group described by torchrun's environment (WORLD_SIZE > 1), once.

    Returns True when this process is part of a multi-process group afterwards.
    """
    if active():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend)
    log.info("calibration split across %d processes (%s), this is rank %d", world_size(), backend, rank())
    return True


def my_samples(n: int) -> list[int]:
    """Indices of the calibration samples this rank runs."""
    return list(range(rank(), n, world_size()))


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    if dist.get_backend() == "nccl":
        return t.cuda()
    return t.cpu()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if not active():
        return t
    x = _on_comm_device(t.contiguous().clone())
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x.to(t.device)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if not active():
        return t
    x = _on_comm_device(t.contiguous().clone())
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.to(t.device)


def gather_dict(d: dict[int, Any]) -> dict[int, Any]:
    """Union of every rank's {sample index: tensor} (keys are disjoint across ranks)."""
    if not active():
        return d
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in d.items()})
    out: dict[int, Any] = {}
    for p in parts:
        out.update(p)
    return out
