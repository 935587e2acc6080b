"""Every method follows its tensors' device: the code path CUDA takes (the plain-torch backend), run on CPU
tensors while torch's default device is `meta`.  A tensor made without a device (`torch.zeros(n)`) lands
on meta and any arithmetic with the CPU inputs raises, so equal results prove that nothing is made on the
default device instead of the weights' one.  And only the compiled CPU accelerators touch numpy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fewbits.calib.stats import InputStats
from fewbits.methods.awq import apply_clip, awq_search_scales, fold_scales, search_clip
from fewbits.methods.backend import ENV
from fewbits.methods.gptq import gptq_quantize
from fewbits.methods.hqq import hqq_quantize
from fewbits.methods.llm_int8 import Int8OutlierLinear, llm_int8_matmul
from fewbits.methods.rtn import rtn_quantize
from fewbits.methods.smoothquant import quantize_per_token, smooth_scales

ROOT = Path(__file__).resolve().parents[2] / "fewbits"
#: the compiled CPU accelerators (chosen by fewbits.methods.backend only for CPU tensors)
CPU_ONLY = {"methods/gptq_loop.py", "calib/hessian_numba.py"}


def _every_method(w: torch.Tensor, x: torch.Tensor) -> dict:
    h = x.T @ x
    out: dict = {}
    for spec in ("int4-g64", "int4-g32-asym", "int4", "int4-t", "int3-g64-narrow"):
        for act_order in (False, True):
            out["gptq", spec, act_order] = gptq_quantize(w, h, spec, act_order=act_order).dequantize()
    dead = h.clone()
    dead[3, :] = 0
    dead[:, 3] = 0
    out["gptq dead column"] = gptq_quantize(w, dead, "int4-g64").dequantize()
    out["gptq no data"] = gptq_quantize(w, h * 0, "int4-g64").dequantize()
    out["gptq singular"] = gptq_quantize(w, x[:8].T @ x[:8], "int4-g64", damp=0.0).dequantize()
    found = awq_search_scales(x, [w], "int4-g64")
    out["awq scales"] = found.scales
    out["awq clip"] = apply_clip(w, search_clip(w, x, "int4-g64"), "int4-g64")
    norm, nxt = torch.ones_like(w[0]), w.clone()
    fold_scales(norm, None, [nxt], found.scales)
    out["awq fold"] = (norm, nxt)
    for spec in ("int4-g64-asym-zfp16", "int3-g64-asym", "int4-g64"):
        out["hqq", spec] = hqq_quantize(w, spec).dequantize()
    out["smooth"] = smooth_scales(x.abs().amax(0), [w])
    out["per token"] = quantize_per_token(x)
    out["llm.int8"] = llm_int8_matmul(x * 3, w)
    out["llm.int8 layer"] = Int8OutlierLinear(w)(x * 3)
    out["rtn"] = rtn_quantize(w, "int4-g64").dequantize()
    st = InputStats("lin", w.shape[1], keep_samples=2)
    for i in range(4):
        st.add(x[None, i * 64:(i + 1) * 64], (i,))
    out["stats"] = (st.hessian_mean(), st.inputs(), st.mean_abs, st.absmax)
    return out


def test_methods_make_nothing_on_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "torch")  # the plain path, which CUDA tensors take
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.02
    x = torch.randn(256, 128, generator=g)
    ref = _every_method(w, x)
    with torch.device("meta"):
        assert torch.zeros(1).device.type == "meta"  # the trap is set
        got = _every_method(w, x)
    for key, want in ref.items():
        have = got[key]
        for a, b in zip(have if isinstance(have, tuple) else (have,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            assert a.device.type == "cpu" and torch.equal(a, b), key


def test_only_the_cpu_accelerators_view_tensors_as_numpy() -> None:
    """Tensors viewed as numpy arrays, or numba-compiled code, only where CPU tensors are guaranteed."""
    pattern = re.compile(r"\.numpy\(|from numba import")
    files = sorted(p for d in ("methods", "calib") for p in (ROOT / d).glob("*.py"))
    assert len(files) > 10
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if pattern.search(p.read_text()) and str(p.relative_to(ROOT)) not in CPU_ONLY]
    assert offenders == []
    for name in CPU_ONLY:  # and they still exist (the list is not stale)
        assert pattern.search((ROOT / name).read_text()), name
