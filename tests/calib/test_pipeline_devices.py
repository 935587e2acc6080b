"""The whole calibration pipeline of every method on the path CUDA takes: the plain-torch backend, run on
a CPU model while torch's default device is `meta`, so a tensor made without a device anywhere in the
block runner, the statistics or the methods would break the run (as in tests/methods/test_device_generic.py).
The compiled CPU backend gives the same model."""

from __future__ import annotations

import pytest
import torch
from test_runner import quantize  # the same recipe-and-commit helper as the runner tests

from fewbits.methods.backend import ENV, numba_available

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("method", "spec"), METHODS)
def test_every_method_on_a_cuda_model(tiny, calib_ids, eval_ids, method: str, spec: str) -> None:
    """On a CUDA model every method calibrates there and gives nearly the CPU's model (float32 kernels
    round differently on a GPU: GPTQ codes may differ at rounding ties)."""
    logits = {}
    for dev in ("cpu", "cuda"):
        model = tiny("llama").to(dev)
        quantize(model, method, spec, calib_ids)
        assert all(t.device.type == dev for t in [*model.parameters(), *model.buffers()])
        with torch.no_grad():
            logits[dev] = model(eval_ids.to(dev)).logits.float().log_softmax(-1).cpu()
    kl = float((logits["cpu"].exp() * (logits["cpu"] - logits["cuda"])).sum(-1).mean())
    assert kl < 1e-3, kl
