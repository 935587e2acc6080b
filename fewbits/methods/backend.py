"""Which implementation runs a calibration kernel: the plain torch one, or the compiled CPU accelerator.

Every kernel a calibrated method needs (GPTQ's column loop, the mean of the Hessian's partial sums) is
written once in plain torch, which runs on whatever device the tensors are on (CPU or CUDA) and is the
specification.  On CPU the same kernels also exist compiled with numba (`fewbits.methods.gptq_loop`,
`fewbits.calib.hessian_numba`): the column loop is thousands of tiny steps, which torch pays a dispatch
for each, numba does not.  The accelerator is tested code-for-code against the plain path
(tests/methods/test_backend_equivalence.py, tests/calib/test_stats.py).

    choose(device)             -> "numba" for CPU tensors when numba imports, else "torch"
    choose(device, "torch")    -> "torch" (any device)
    FEWBITS_CALIB_BACKEND=torch python -m fewbits quantize ...   # the same for a whole run (tests, timing)

Forcing "numba" on a CUDA tensor, or without numba installed, is an error that says so.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from fewbits.methods.common import MethodError

#: environment variable that forces a backend for every calibration kernel: auto, torch or numba
ENV = "FEWBITS_CALIB_BACKEND"
CHOICES = ("auto", "torch", "numba")


@cache
def numba_available() -> bool:
    """True when numba can be imported (it compiles the CPU accelerators)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def choose(device: torch.device | str, backend: str | None = None) -> str:
    """"torch" or "numba" for tensors on `device`: `backend` when given, else $FEWBITS_CALIB_BACKEND, else auto
    (numba on CPU when it imports, torch otherwise)."""
    source = "backend argument" if backend is not None else ENV
    want = (backend if backend is not None else os.environ.get(ENV) or "auto").strip().lower()
    if want not in CHOICES:
        raise MethodError(f"{source}: unknown calibration backend {want!r}; one of {', '.join(CHOICES)}")
    dev = torch.device(device)
    if want == "torch":
        return "torch"
    if want == "numba":
        if dev.type != "cpu":
            raise MethodError(f"{source}: the numba backend runs on CPU tensors only, these are on {dev}; "
                              f"use torch (or auto)")
        if not numba_available():
            raise MethodError(f"{source}: the numba backend needs numba, which does not import here; use torch")
        return "numba"
    return "numba" if dev.type == "cpu" and numba_available() else "torch"
