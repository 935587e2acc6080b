"""The whole calibration pipeline of every method on the path CUDA takes: the plain-torch backend, run on
a CPU model while torch's default device is `meta`, so a tensor made without a device anywhere in the
block runner, the statistics or the methods would break the run (as in tests/methods/test_device_generic.py).
The compiled CPU backend gives the same model."""

from __future__ import annotations

import pytest
import torch

from fewbits.methods.backend import ENV, numba_available

from test_runner import quantize  # the same recipe-and-commit helper as the runner tests

METHODS = [("gptq", "int4-g16"), ("awq+gptq", "int4-g16"), ("awq", "int4-g16"), ("hqq", "int4-g16-asym"),
           ("smoothquant", "int8"), ("llm-int8", "int8")]


@pytest.mark.parametrize(("method", "spec"), METHODS)
def test_every_method_runs_on_the_models_device_only(tiny, calib_ids, eval_ids, monkeypatch: pytest.MonkeyPatch,
                                                     method: str, spec: str) -> None:
    logits = {}
    for run in ("torch", "torch under meta", "numba"):
        if run == "numba" and not numba_available():
            continue
        monkeypatch.setenv(ENV, run.split()[0])
        model = tiny("llama")
        if run.endswith("meta"):
            with torch.device("meta"):
                quantize(model, method, spec, calib_ids)
        else:
            quantize(model, method, spec, calib_ids)
        assert all(p.device.type == "cpu" for p in model.parameters())
        with torch.no_grad():
            logits[run] = model(eval_ids).logits
    assert torch.equal(logits["torch under meta"], logits["torch"])
    if "numba" in logits:  # code for code, up to rounding ties (none on this model)
        assert torch.allclose(logits["numba"], logits["torch"], rtol=0, atol=1e-4)
