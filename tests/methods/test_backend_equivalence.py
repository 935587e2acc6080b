"""GPTQ's compiled CPU column loop against the plain-torch one (the specification), code for code.

The two do the same float32 operations in the same order; only the lazy update's matrix product is
laid out differently (transposed in the compiled loop), which a BLAS may round differently.  So: (1) on a
problem where every operation is exact (dyadic weights, power-of-two scales and factor diagonal, +-1
factor entries), with many rounding ties, every code must be equal; (2) on random layers in float32,
codes may differ only where a weight sat on a rounding tie, and a changed code then moves the rest of
its row: few rows differ, each first by one step, and the layer error is the same.  (With this project's
CPU builds no code differs at all.)
"""

from __future__ import annotations

import pytest
import torch

from fewbits.formats.format import parse_format
from fewbits.methods.backend import numba_available
from fewbits.methods.gptq import gptq_columns, gptq_quantize, layer_output_error

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not installed: nothing to compare")


def _compiled(*args):  # noqa: ANN002, ANN202
    from fewbits.methods.gptq_loop import gptq_columns_compiled

    return gptq_columns_compiled(*args)


def _dyadic(spec: str, act_order: bool, rows: int = 24, cols: int = 96, seed: int = 0):
    """Weights, factor, order and static scales for which float32 arithmetic is exact in any order."""
    fmt = parse_format(spec)
    g = torch.Generator().manual_seed(seed)
    n_groups = cols // fmt.group_size
    scale = 2.0 ** torch.randint(-6, -3, (rows, n_groups), generator=g).float()
    zero = torch.randint(0, 2**fmt.bits, (rows, n_groups), generator=g).float() if not fmt.symmetric else None
    per_col = scale.repeat_interleave(fmt.group_size, 1)
    W = torch.randint(-18, 18, (rows, cols), generator=g).float() * per_col / 2  # half steps: ties everywhere
    # U = diag(d) (I + N): d powers of two, N strictly upper with a few +-1 entries, some across lazy blocks
    N = torch.zeros(cols, cols)
    src = torch.randint(0, cols - 1, (cols // 3,), generator=g)
    for i in src.tolist():
        k = int(torch.randint(i + 1, cols, (1,), generator=g))
        N[i, k] = 1.0 if int(torch.randint(0, 2, (1,), generator=g)) else -1.0
    d = 2.0 ** torch.randint(-1, 2, (cols,), generator=g).float()
    U = d[:, None] * (torch.eye(cols) + N)
    order = torch.randperm(cols, generator=g) if act_order else torch.arange(cols)
    return fmt, W, U, order, scale, zero, N


@pytest.mark.parametrize("spec", ["int4-g16", "int4-g16-asym", "int3-g32", "int2-g16-narrow"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block", [32, 48])
def test_exact_arithmetic_gives_equal_codes_including_ties(spec: str, act_order: bool, block: int) -> None:
    fmt, W, U, order, scale, zero, N = _dyadic(spec, act_order)
    args = (W, U, order, scale, zero, fmt, block, True, "w")
    codes_t, loss_t = gptq_columns(*args)
    codes_c, loss_c = _compiled(*args)
    assert torch.equal(codes_t, codes_c)
    assert torch.allclose(loss_t, loss_c, rtol=1e-6, atol=0)
    assert torch.equal(W, args[0])  # the caller's weight is left alone by both
    # the test means something only if ties were rounded: columns no update reaches keep their half steps
    untouched = (N[order][:, order].abs().sum(0) == 0)  # in quantisation order: no earlier column feeds them
    per_col = scale.repeat_interleave(fmt.group_size, 1)[:, order]
    half = (W[:, order] / per_col * 2).remainder(2) == 1
    assert int(half[:, untouched].sum()) > 200


def _layer(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    mix = torch.eye(cols) + torch.randn(cols, cols, generator=g) / cols**0.5
    x = torch.randn(4 * cols, cols, generator=g) @ mix
    x[:, 5] *= 8  # a salient channel
    return w, x


@pytest.mark.parametrize("spec", ["int4-g64", "int3-g32-asym", "int4", "int8", "int4-t"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("static_groups", [False, True])
def test_random_layers_differ_only_from_rounding_ties(spec: str, act_order: bool, static_groups: bool) -> None:
    """Codes of the two backends on float32 random layers: rows that differ are rare, each starts with a
    code one step apart (a tie resolved the other way, then its error spread along the row); the
    dynamic group scales come from the weights as updated, so an fp16 rounding tie can flip one of them."""
    rows_total = differing_rows = 0
    for seed in range(4):
        w, x = _layer(192, 256, seed)
        h = x.T @ x / x.shape[0]
        kw = {"act_order": act_order, "static_groups": static_groups}
        a = gptq_quantize(w, h, spec, backend="torch", **kw)
        b = gptq_quantize(w, h, spec, backend="numba", **kw)
        order = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(256)
        diff = (a.codes.int() - b.codes.int())[:, order]  # in quantisation order
        rows = diff.ne(0).any(1)
        rows_total += w.shape[0]
        differing_rows += int(rows.sum())
        for r in torch.nonzero(rows).flatten().tolist():
            first = int(torch.nonzero(diff[r]).flatten()[0])
            assert abs(int(diff[r, first])) == 1, (spec, seed, r)
        # dynamic scales differ in the rows that diverged, and elsewhere only by an fp16 tie
        other_scales = (a.scale != b.scale).any(1) & ~rows
        assert int(other_scales.sum()) <= (0 if static_groups or act_order else 2)
        ea = layer_output_error(w, a.dequantize(), x)
        eb = layer_output_error(w, b.dequantize(), x)
        assert abs(ea - eb) <= 0.01 * eb, (spec, ea, eb)
    assert differing_rows <= 0.01 * rows_total, (spec, differing_rows, rows_total)
