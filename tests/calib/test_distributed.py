"""Calibration split over two CPU processes (gloo) gives the same weights as one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(spec: str, out: Path, world: int) -> dict:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if world == 1:
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), spec, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, text[-3000:]
    return torch.load(out)


def test_two_processes_give_the_same_weights(tmp_path: Path) -> None:
    ones = _run("int4-g32", tmp_path / "one.pt", 1)
    twos = _run("int4-g32", tmp_path / "two.pt", 2)
    for method in ("gptq", "awq"):
        _same(ones[method], twos[method])


def _same(one: dict, two: dict) -> None:
    assert one["world"] == 1 and two["world"] == 2
    assert one["weights"].keys() == two["weights"].keys() and len(one["weights"]) == 14
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=1e-6, rtol=0), name
    for name, w in one["norms"].items():  # AWQ folds scales into the norms: those must agree too
        assert torch.allclose(w, two["norms"][name], atol=1e-6, rtol=1e-5), name
