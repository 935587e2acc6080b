"""Run one calibrated method on the tiny llama; used by test_distributed.py as a one- or two-process job.

usage: python dist_worker.py SPEC OUT.pt   (runs gptq and awq)   (rank and world size from torchrun-style env variables)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_tiny  # noqa: E402

from fewbits.calib import distributed as dist_util  # noqa: E402
from fewbits.calib.pipeline import run_awq, run_gptq  # noqa: E402
from fewbits.models.recipe import Recipe  # noqa: E402
from fewbits.models.swap import linear_shapes, swap_in  # noqa: E402


def run(method: str, spec: str) -> dict:
    model = make_tiny("llama", layers=2)
    data = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(1))
    plans = [p for p in Recipe.from_format(spec, method).plan(linear_shapes(model)) if p.action == "quantize"]
    store: dict[str, torch.Tensor] = {}

    def commit(name, q):
        store[name] = q.dequantize()
        swap_in(model, name, q)

    info = {"gptq": run_gptq, "awq": run_awq}[method](model, plans, data, commit, False)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    return {"weights": store, "norms": norms, "info": info, "world": dist_util.world_size()}


def main(spec: str, out: str) -> None:
    torch.set_num_threads(1)
    dist_util.init_from_env()
    res = {m: run(m, spec) for m in ("gptq", "awq")}
    if dist_util.rank() == 0:
        torch.save(res, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
