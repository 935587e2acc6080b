"""The registered operators the compiled step calls: torch.library's own consistency checks (fake
implementation, schema, dispatch), the same numbers as the kernels' eager calls, and one compiled graph."""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels import ops
from fewbits.kernels.cpu import Fp8DequantKernel, Int4PackKernel, Int8PackKernel
from fewbits.tensor import quantize_tensor


def _kernel(cls, spec: str, n: int = 64, k: int = 128):  # noqa: ANN001, ANN202
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    return cls(quantize_tensor(w, spec))


CASES = [
    (Int4PackKernel, "int4-g32", lambda kn, x: (ops.int4pack_mm, (x, kn.packed, kn.group, kn.scales_zeros))),
    (Int8PackKernel, "int8", lambda kn, x: (ops.int8pack_mm, (x, kn.q, kn.scales))),
    (Fp8DequantKernel, "fp8-e4m3", lambda kn, x: (ops.fp8_dequant_mm, (x, kn.w8, kn.lut_t, kn.scales, 128))),
]


@pytest.mark.parametrize(("cls", "spec", "call"), CASES, ids=[c[1] for c in CASES])
def test_registered_op_passes_opcheck_and_equals_the_kernel(cls, spec, call) -> None:  # noqa: ANN001
    kn = _kernel(cls, spec)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    op, args = call(kn, x)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    y = op(*args)
    assert y.shape == (3, 64) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, kn(x), rtol=0, atol=0)


def test_compiled_kernels_are_one_graph_each() -> None:
    """Each kernel's call traced by dynamo: no graph break, its registered operator in the graph."""
    x = torch.randn(2, 128).to(torch.bfloat16)
    for cls, spec, _ in CASES:
        kn = _kernel(cls, spec)
        ex = torch._dynamo.explain(lambda t, kn=kn: kn(t))(x)
        assert ex.graph_break_count == 0 and ex.graph_count == 1, (spec, ex.break_reasons)
        targets = " ".join(str(n.target) for g in ex.graphs for n in g.graph.nodes)
        assert "fewbits." in targets, (spec, targets)
