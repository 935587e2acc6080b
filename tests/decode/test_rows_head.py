"""The 16-bit LM head (and any 16-bit `nn.Linear` through `fewbits.decode.step.linear16`) of a CPU decode step
runs as `fewbits_rows::dense_mm` for a few rows, the module itself otherwise; compiled, the operator stays one
node of the graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits.decode import step
from fewbits.kernels import native, rows

needs_ops = pytest.mark.skipif(not rows.available(), reason=f"no operators: {native.why(rows.NAME)}")


def _lin(dtype: torch.dtype, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(77, 150, bias=bias).to(dtype).requires_grad_(False)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_run_the_operator(dtype: torch.dtype, bias: bool) -> None:
    lin = _lin(dtype, bias)
    for m in range(1, rows.DENSE_MAX_ROWS[dtype] + 1):
        x = torch.randn(1, m, 77).to(dtype)
        y = step.linear16(lin, x)
        direct = torch.ops.fewbits_rows.dense_mm(x[0], lin.weight)
        if bias:
            direct = direct + lin.bias
        assert torch.equal(y[0], direct)
        ref = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
        assert float((y.float() - ref).abs().max()) <= float(ref.abs().max()) * 2 * torch.finfo(dtype).eps + 1e-3


@needs_ops
def test_many_rows_and_other_dtypes_run_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "WIDEN", ())  # a CPU with fast 16-bit GEMMs
    lin = _lin(torch.bfloat16)
    x = torch.randn(rows.DENSE_MAX_ROWS[torch.bfloat16] + 1, 77).to(torch.bfloat16)
    assert torch.equal(step.linear16(lin, x), lin(x))
    lin32 = _lin(torch.float32)
    x32 = torch.randn(2, 77)
    assert torch.equal(step.linear16(lin32, x32), lin32(x32))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_rows_without_fast_16bit_gemm(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's 16-bit CPU matmul is generic loops (`step.WIDEN`): up to TILE_MAX_ROWS rows as dense_mm tiles
    (each tile's rows the operator's own result), more rows in fp32 rounded once; eager and compiled alike."""
    monkeypatch.setattr(step, "WIDEN", (dtype,))
    monkeypatch.setattr(step, "TILE_MAX_ROWS", 20)
    lin = _lin(dtype, bias=True)
    most = rows.DENSE_MAX_ROWS[dtype]
    x = torch.randn(2, 9, 77).to(dtype)  # 18 rows: tiles of `most` rows and a partial one
    x2 = x.reshape(18, 77)
    tiles = torch.cat([torch.ops.fewbits_rows.dense_mm(x2[i:i + most], lin.weight) for i in range(0, 18, most)])
    assert torch.equal(step.linear16(lin, x), (tiles + lin.bias).view(2, 9, 150))
    big = torch.randn(3, 9, 77).to(dtype)  # 27 rows: one fp32 GEMM
    want = (big.float() @ lin.weight.float().T + lin.bias.float()).to(dtype)
    assert torch.equal(step.linear16(lin, big), want)
    for t in (x, big):
        compiled = torch.compile(lambda t: step.linear16(lin, t), fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(t), step.linear16(lin, t))


def test_training_runs_the_module() -> None:
    lin = _lin(torch.bfloat16).requires_grad_(True)
    x = torch.randn(1, 77).to(torch.bfloat16)
    y = step.linear16(lin, x)
    assert y.grad_fn is not None and torch.equal(y, lin(x))


def test_without_the_operators_the_module_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native._BUILT, rows.NAME, False)
    lin = _lin(torch.bfloat16)
    x = torch.randn(1, 77).to(torch.bfloat16)
    assert torch.equal(step.linear16(lin, x), lin(x))
    monkeypatch.setitem(native._BUILT, rows.NAME, True)
    monkeypatch.setenv("FEWBITS_CPU_ROWS", "torch")
    assert torch.equal(step.linear16(lin, x), lin(x))


@needs_ops
def test_compiled_keeps_one_operator_node() -> None:
    lin = _lin(torch.bfloat16)
    x = torch.randn(rows.DENSE_MAX_ROWS[torch.bfloat16], 77).to(torch.bfloat16)  # the most rows it takes
    explain = torch._dynamo.explain(lambda t: step.linear16(lin, t))(x)
    assert explain.graph_break_count == 0
    assert "fewbits_rows.dense_mm" in str(explain.graphs[0].code)
    compiled = torch.compile(lambda t: step.linear16(lin, t), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step.linear16(lin, x))


@needs_ops
@pytest.mark.parametrize("fuse", [True, False])
def test_a_16bit_step_runs_every_projection_on_the_operator(fuse: bool) -> None:
    """A bf16 model's decode step (one row): q/k/v, o, gate/up, down and the head all run as dense_mm (fused:
    4 calls a layer, else 7), and the logits are the model's own to bf16 rounding."""
    from decode_models import build
    from torch.profiler import profile

    from fewbits.decode.runner import StaticDecoder

    model = build("llama", torch.bfloat16)
    dec = StaticDecoder(model, "bf16", 1, 64, compile=False, fuse=fuse)
    ids = torch.tensor([[1, 5, 9, 3]])
    dec.prefill(ids)
    with torch.no_grad(), profile() as prof:
        got = dec.step(torch.tensor([7]))
    calls = sum(e.count for e in prof.key_averages() if e.key == "fewbits_rows::dense_mm")
    assert calls == (4 if fuse else 7) * model.config.num_hidden_layers + 1
    with torch.no_grad():
        want = model(torch.tensor([[1, 5, 9, 3, 7]])).logits[0, -1].float()
    assert (got[0].float() - want).abs().max() <= 0.05 * want.abs().max()
