"""The methods on a CUDA device against the same maths on the CPU (skipped without a GPU).

A GPU's float32 kernels round differently from the CPU's (another matrix-product order, fused multiply-
adds), so GPTQ's codes may differ where a weight sits on a rounding tie, and the rest of that row follows:
few rows, each first by one step, the same layer error."""

from __future__ import annotations

import pytest
import torch

from fewbits.calib.stats import InputStats
from fewbits.methods.awq import awq_search_scales, search_clip
from fewbits.methods.gptq import gptq_quantize, layer_output_error
from fewbits.methods.hqq import hqq_quantize
from fewbits.methods.smoothquant import smooth_scales

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _layer(rows: int = 256, cols: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    x = torch.randn(4 * cols, cols, generator=g) @ (torch.eye(cols) + torch.randn(cols, cols, generator=g) / cols**0.5)
    return w, x


@pytest.mark.parametrize("spec", ["int4-g64", "int3-g32-asym", "int4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_cuda_matches_the_cpu_up_to_ties(spec: str, act_order: bool) -> None:
    w, x = _layer()
    h = x.T @ x / x.shape[0]
    cpu = gptq_quantize(w, h, spec, act_order=act_order)
    gpu = gptq_quantize(w.cuda(), h.cuda(), spec, act_order=act_order)
    assert gpu.codes.device.type == "cuda" and gpu.scale.device.type == "cuda"
    codes = gpu.codes.cpu()
    rows = (codes != cpu.codes).any(1)
    assert int(rows.sum()) <= 0.05 * w.shape[0], int(rows.sum())
    e_cpu = layer_output_error(w, cpu.dequantize(), x)
    e_gpu = layer_output_error(w, gpu.dequantize().cpu(), x)
    assert abs(e_gpu - e_cpu) <= 0.01 * e_cpu, (e_gpu, e_cpu)


def test_gptq_takes_a_bfloat16_weight_and_a_cpu_hessian() -> None:
    w, x = _layer(seed=1)
    res = gptq_quantize(w.cuda().bfloat16(), x.T @ x, "int4-g64", act_order=True)  # the Hessian follows the weight
    assert res.codes.device.type == "cuda" and res.scale.dtype == torch.float32


def test_statistics_and_searches_stay_on_cuda_and_agree_with_the_cpu() -> None:
    w, x = _layer(seed=2)
    st = {d: InputStats("lin", x.shape[1], keep_samples=1) for d in ("cpu", "cuda")}
    for d, s in st.items():
        for i in range(4):
            s.add(x[None, i * 512:(i + 1) * 512].to(d).bfloat16(), (i,))
    h_cpu, h_gpu = st["cpu"].hessian_mean(), st["cuda"].hessian_mean()
    assert h_gpu.device.type == "cuda"
    assert torch.allclose(h_gpu.cpu(), h_cpu, rtol=1e-5, atol=1e-5 * float(h_cpu.abs().max()))
    a_cpu = awq_search_scales(x[:512], [w], "int4-g64")
    a_gpu = awq_search_scales(x[:512].cuda(), [w.cuda()], "int4-g64")
    assert a_gpu.scales.device.type == "cuda" and a_gpu.alpha == a_cpu.alpha
    assert search_clip(w.cuda(), x[:128].cuda(), "int4-g64").device.type == "cuda"
    assert hqq_quantize(w.cuda(), "int4-g64-asym-zfp16").codes.device.type == "cuda"
    assert smooth_scales(x.abs().amax(0).cuda(), [w.cuda()]).device.type == "cuda"
