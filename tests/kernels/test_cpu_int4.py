"""fewbits' own <= 4-bit CPU operator (`fewbits.kernels.cpu_int4`) against dequantise-then-matmul.

The operator multiplies the exact centred codes by bf16 activations in fp32 and rounds the output once to bf16,
so against an fp32 product of the same dequantised weight each output is within a bf16 rounding (2^-8
relative) plus fp32 accumulation-order error (bounded here by 1e-4 x sum_k |x_k w_k|): a wrong code, scale,
zero point or layout is off by orders of magnitude more.  Every path is checked: the fastest built (AMX from 3
rows, where the CPU has it; at fewer rows, or up to 8 without AMX, with AVX512-VNNI x in int16, below), vdpbf16ps
alone, the AVX2 path (its
uncentred codes: the centring term is subtracted per group; one row of x in int16, `cpu_int4.int16_blocks`, whose
rounding of the elements below 2^-7 of their block's largest stays far inside that bound; and its fp32 path at one
row too) and the portable loops.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fewbits.formats.format import parse_format
from fewbits.formats.packing import pack_bits
from fewbits.kernels import cpu_int4, native, prepare_linear
from fewbits.kernels.cpu import Int4PackKernel
from fewbits.kernels.cpu_int4 import Q4Kernel
from fewbits.tensor import quantize_tensor

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason=f"q4 operator not built: {native.why(cpu_int4.NAME)}")

SPECS = ["int4-g32", "int4-g64", "int4-g128", "int4", "int4-t", "int4-g32-asym", "int4-g64-asym", "int3-g64",
         "int3-g32-asym", "int2-g32", "int2-g64-asym", "int4-g128-asym-zfp16", "int3-asym-zbf16", "int4-g64-narrow",
         "int4-g96"]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 128]
PATHS = {"fastest": 0, "portable": 1, "dpbf16": 2, "no-amx": 5}


def _case(spec: str, n: int, k: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g)) * 0.02
    w += torch.rand(n, 1, generator=g) * 0.01  # rows off centre: zero points away from the middle code
    return quantize_tensor(w, spec), g


def _kernel(qt, path: str) -> Q4Kernel:  # noqa: ANN001
    k = Q4Kernel(qt)
    if path.startswith("avx2"):  # the AVX2 path: the main build on an AVX2 CPU, else the build without AVX-512
        k.path = 4 if path == "avx2-fp32" else 0  # avx2-fp32: x in fp32 at one row too
        if int(torch.ops.fewbits_q4.q4_isa()) & 8:
            return k
        if not _has_avx2():
            pytest.skip("this CPU has no AVX2 + FMA + F16C")
        if not cpu_int4.build_avx2():
            pytest.skip(f"no build without AVX-512: {native.why(cpu_int4.AVX2_NAME)}")
        assert int(torch.ops.fewbits_q4avx2.q4_isa()) & 8, "the build without AVX-512 has no AVX2 path"
        k._op = torch.ops.fewbits_q4avx2.q4_mm.default
        return k
    k.path = PATHS[path]
    return k


def _has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= set(native.cpu_flags().split())


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bf16) against the fp32 product x @ w.T (module docstring's bound)."""
    ref = x.float() @ w.T
    bound = 2.0**-8 * ref.abs() + 1e-4 * (x.float().abs() @ w.abs().T) + 1e-30
    excess = ((y.float() - ref).abs() - bound).max()
    assert excess <= 0, f"error exceeds the bound by {float(excess):.3g} (max |ref| {float(ref.abs().max()):.3g})"


@pytest.mark.parametrize("path", [*PATHS, "avx2", "avx2-fp32"])
@pytest.mark.parametrize("spec", SPECS)
def test_matches_dequantise_then_matmul(spec: str, path: str) -> None:
    k_in = 192 if spec == "int4-g96" else 256
    qt, g = _case(spec, 48, k_in, seed=len(spec))
    kern = _kernel(qt, path)
    w = qt.dequantize(torch.float32)
    for m in ROWS:
        x = torch.randn(m, k_in, generator=g).to(torch.bfloat16)
        y = kern(x)
        assert y.shape == (m, 48) and y.dtype == torch.bfloat16
        _check(y, x, w)


@pytest.mark.parametrize("spec", ["int4-g32", "int3-g64-asym", "int4-g128-asym-zfp16", "int2-g32"])
def test_decode_is_the_reference_weight_bit_for_bit(spec: str) -> None:
    """The operator's own decode (table lookup, scale, zero offset) as a bf16 weight equals the numeric core's
    fp32 dequantisation rounded to bf16, on both paths: the packing and the layout are exact."""
    qt, _ = _case(spec, 64, 256)
    want = qt.dequantize(torch.float32).to(torch.bfloat16)
    for path in ("fastest", "portable"):
        assert torch.equal(_kernel(qt, path).dequantized(), want)


def test_paths_agree_and_fp32_input_and_bias() -> None:
    """The portable loops give the fast path's result to accumulation order; fp32 inputs come back fp32,
    leading dimensions and the bias as F.linear has them."""
    qt, g = _case("int4-g32-asym", 64, 320)
    fast, port = _kernel(qt, "fastest"), _kernel(qt, "portable")
    x = torch.randn(2, 3, 320, generator=g)
    b = torch.randn(64, generator=g)
    y = fast(x, b)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    torch.testing.assert_close(y, port(x, b), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, qt.dequantize(torch.float32), b), rtol=1e-2,
                               atol=1e-2)


def test_storage_is_one_packed_copy() -> None:
    qt, _ = _case("int4-g32", 96, 256)
    kern = Q4Kernel(qt)
    assert kern.codes.shape == (6, 32, 32) and kern.scales.dtype == torch.float16 and kern.zeros.numel() == 0
    assert kern.nbytes == 96 * 256 // 2 + 96 * 8 * 2
    asym = Q4Kernel(quantize_tensor(torch.randn(96, 256), "int4-g64-asym"))
    assert asym.nbytes == 96 * 256 // 2 + 2 * 96 * 4 * 2


def test_symmetric_kernels_share_one_empty_zeros_tensor() -> None:
    """Every symmetric kernel holds the same empty zero-point tensor of its scales' dtype (a compiled step takes
    each distinct tensor as an input: one, not one per layer), never written; asymmetric ones their own."""
    qa, g = _case("int4-g32", 48, 256, seed=1)
    a = Q4Kernel(qa)
    b = Q4Kernel(_case("int4-g64", 64, 128, seed=2)[0])
    assert a.zeros is b.zeros is cpu_int4.no_zeros(a.scales.dtype) and a.zeros.numel() == 0
    asym = Q4Kernel(quantize_tensor(torch.randn(96, 256), "int4-g64-asym"))
    assert asym.zeros.numel() == asym.scales.numel() and asym.zeros is not a.zeros
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    _check(a(x), x, qa.dequantize(torch.float32))
    assert cpu_int4.no_zeros(torch.float32).numel() == 0 and cpu_int4.no_zeros(torch.float32).dtype == torch.float32
    c, d = copy.deepcopy(a), copy.deepcopy(asym)  # copies: codes and scales their own, the empty zeros shared
    assert c.zeros is a.zeros and c.codes is not a.codes and torch.equal(c.codes, a.codes) and torch.equal(c(x), a(x))
    assert d.zeros is not asym.zeros and torch.equal(d.zeros, asym.zeros)


@pytest.mark.parametrize("spec", ["int4-g32", "int4-g64-asym", "int3-g64", "int2-g32-asym", "int4-g128-asym-zfp16"])
def test_a_bound_kernel_reads_its_block_by_offsets_bit_for_bit(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bind`: the operator reads the codes, scales and zeros from the block they were placed in, by their offsets
    (`q4_mm_at`), with the same output as over the tensors; copies are not bound, the block is not one of the
    kernel's own tensors, a kernel whose tensors moved since unbinds at its next call, and one whose tensors lie
    outside a block is not bound to it."""
    from fewbits.decode import pages

    if pages.why_not_huge(huge=False) is not None:
        pytest.skip(pages.why_not_huge(huge=False))
    monkeypatch.setattr(pages, "HUGE", 4096)  # one kernel's tensors fill less than one huge page
    qt, g = _case(spec, 48, 256, seed=3)
    k = Q4Kernel(qt)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    want = k(x)
    placed = pages.place([k], huge=False, min_bytes=0)
    assert placed.block is not None and k.bind(placed.block)
    assert k._at is not None and k._at[8] == int(k.scales.dtype == torch.float16)
    assert torch.equal(k(x), want)
    assert all(t is not placed.block for t in pages.tensors_of([k]))
    c = copy.deepcopy(k)
    assert c._at is None and torch.equal(c(x), want)
    pages.place([k], huge=False, again=True, min_bytes=0)  # moved again: the block no longer holds them
    assert torch.equal(k(x), want) and k._at is None
    assert not Q4Kernel(qt).bind(placed.block)


def test_reads_outside_the_block_are_refused() -> None:
    x = torch.randn(1, 64).to(torch.bfloat16)
    block = torch.zeros(1000, dtype=torch.uint8)  # 16 x 64 codes are 512 bytes, their fp16 scales 64
    torch.ops.fewbits_q4.q4_mm_at(x, block, 0, 512, -1, 16, 64, 32, 4, 1, 0)  # inside: runs
    for codes, scales, zeros in ((600, 0, -1), (0, 980, -1), (0, 512, 960), (1, 512, -1)):
        with pytest.raises(RuntimeError, match="outside the arena"):
            torch.ops.fewbits_q4.q4_mm_at(x, block, codes, scales, zeros, 16, 64, 32, 4, 1, 0)


@pytest.mark.parametrize(("spec", "shape", "why"), [
    ("int4-g32", (40, 128), "out_features divisible by 16"),
    ("int4", (64, 132), "in_features by 8"),
    ("int4-g12", (64, 96), "multiple of 8"),
    ("int4-g64", (64, 96), "divides in_features 96"),
    ("int6-g64", (64, 128), "at most 4 bits"),
    ("int8", (64, 128), "at most 4 bits"),
    ("fp8-e4m3", (64, 128), "integer codes"),
])
def test_unsupported_shapes_and_formats_are_declined_with_a_reason(spec: str, shape: tuple, why: str) -> None:
    from fewbits.formats.format import parse_format

    reason = Q4Kernel.supports(parse_format(spec), shape)
    assert reason is not None and why in reason, reason
    if spec in ("int4-g32", "int4"):  # building one anyway is a clear error, not a crash
        with pytest.raises(ValueError, match=why):
            Q4Kernel(quantize_tensor(torch.randn(*shape), spec))


def test_bad_inputs_raise() -> None:
    qt, _ = _case("int4-g32", 32, 128)
    kern = Q4Kernel(qt)
    with pytest.raises(ValueError, match="does not match"):
        kern(torch.randn(1, 96))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        kern._op(torch.randn(1, 128), kern.codes, kern.scales, kern.zeros, kern.group, kern.bits, 0)
    with pytest.raises(RuntimeError, match="group"):
        kern._op(torch.randn(1, 128).bfloat16(), kern.codes, kern.scales, kern.zeros, 12, kern.bits, 0)


def test_dispatch_prefers_it_and_falls_back_to_torchs_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    qt, g = _case("int4-g64", 64, 256)
    x = torch.randn(3, 256, generator=g)
    expected = Q4Kernel.name if cpu_int4.fast_path() else Int4PackKernel.name
    assert prepare_linear(qt).name == expected
    monkeypatch.setenv("FEWBITS_CPU_INT4", "torch")
    kern = prepare_linear(qt)
    assert kern.name == Int4PackKernel.name
    monkeypatch.delenv("FEWBITS_CPU_INT4")
    monkeypatch.setitem(native._BUILT, cpu_int4.NAME, False)  # as if there were no compiler
    monkeypatch.setitem(native._WHY, cpu_int4.NAME, "no compiler")
    assert "could not be built (no compiler)" in Q4Kernel.supports(qt.fmt, qt.shape)
    kern = prepare_linear(qt)
    assert kern.name == Int4PackKernel.name
    ref = x @ qt.dequantize(torch.float32).T
    assert float((kern(x) - ref).norm() / ref.norm()) < 1e-2


def test_compiled_graph_keeps_one_operator_node() -> None:
    qt, g = _case("int4-g32", 64, 128)
    kern = Q4Kernel(qt)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    ex = torch._dynamo.explain(lambda t: kern(t) * 2)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    targets = [str(n.target) for gr in ex.graphs for n in gr.graph.nodes if n.op == "call_function"]
    assert sum("fewbits_q4.q4_mm" in t for t in targets) == 1, targets


@pytest.mark.parametrize("build", ["avx2", "avx512"])
@pytest.mark.parametrize("spec", ["int4-g32", "int4-g64-asym", "int4", "int3-g64", "int2-g32", "int4-g128-asym-zfp16"])
def test_few_rows_in_int16_are_the_int16_blocks_times_the_weight(spec: str, build: str) -> None:
    """One row of x (group a multiple of 32) on the AVX2 path (vpmaddwd), and 1 to 8 rows with AVX512-VNNI
    (vpdpwssd; as a CPU without AMX runs them, path 5), multiply `int16_blocks`' values, not x: to fp32 summation
    (1e-6 x sum |x w|) and one bf16 rounding, against an x whose blocks span 2^12 in magnitude (the small elements
    rounded, so one activation's code off by a step, or a pair's columns swapped, exceeds it)."""
    qt, g = _case(spec, 64, 256, seed=len(spec))
    if build == "avx512":
        if not int(torch.ops.fewbits_q4.q4_isa()) & 16:
            pytest.skip("the main build has no AVX512-VNNI int16 path here")
        kern, rows = _kernel(qt, "no-amx"), range(1, 9)
    else:
        kern, rows = _kernel(qt, "avx2"), [1]
    w = qt.dequantize(torch.float32).double()
    for m in rows:
        x = torch.randn(m, 256, generator=g) * torch.logspace(-3, 1, 256)[torch.randperm(256, generator=g)]
        x = x.to(torch.bfloat16)
        q, d = cpu_int4.int16_blocks(x)
        xr = (q.double().view(m, 8, 32) * d.double()[..., None]).view(m, 256)
        assert not torch.equal(xr, x.double()), "the case should round some activations"
        ref = xr @ w.T
        bound = 2.0**-8 * ref.abs() + 1e-6 * (xr.abs() @ w.abs().T)
        y = kern(x).double()
        assert ((y - ref).abs() - bound).max() <= 0, (spec, m)


def test_a_non_finite_activation_reaches_every_output() -> None:
    """A row of x holding a NaN or an Inf gives no finite output on any path (NaN, or +-Inf where the code is
    off centre), as a plain product does: the int16 paths hand such an x to the path that takes x as it is
    (AVX2: fp32; AVX-512: vdpbf16ps, or AMX)."""
    qt, g = _case("int4-g32", 48, 256)
    for path in ("fastest", "portable", "dpbf16", "no-amx", "avx2"):
        kern = _kernel(qt, path)
        for bad in (float("nan"), float("inf")):
            for m in (1, 2, 5):
                x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
                x[m - 1, 37] = bad
                assert not torch.isfinite(kern(x)[m - 1]).any(), (path, bad, m)


needs_a8 = pytest.mark.skipif(not cpu_int4.a8_path(), reason="no int8-activation path (AVX512-VNNI, AVX2) here")
A8_SPECS = ["int4-g32", "int4-g64", "int4", "int4-g64-asym", "int3-g64", "int2-g32", "int4-g128-asym-zfp16"]


@needs_a8
@pytest.mark.parametrize("build", ["main", "avx2"])
@pytest.mark.parametrize("spec", A8_SPECS)
def test_int8_activations_are_the_blocks_times_the_weight(spec: str, build: str) -> None:
    """`cpu_q4_a8` at every row count: the product of `act8`'s rounded activations and the exact weight, to fp32
    summation (1e-6 x sum |x w|) and one bf16 rounding: one activation code off by one step would exceed it.
    build "avx2": the vpmaddubsw path (on an AVX-512 host the source built without AVX-512; on an AVX2 host the
    main build, so skipped as a duplicate)."""
    from fewbits.kernels.act8 import dequantize_blocks, quantize_blocks

    qt, g = _case(spec, 64, 256, seed=len(spec))
    kern = cpu_int4.Q4A8Kernel(qt)
    if build == "avx2":
        if int(torch.ops.fewbits_q4.q4_isa()) & 8:
            pytest.skip("the main build is the AVX2 path on this CPU")
        kern._op = _kernel(qt, "avx2")._op
        assert int(torch.ops.fewbits_q4avx2.q4_isa()) & 4, "the build without AVX-512 has no int8-activation path"
    w = qt.dequantize(torch.float32).double()
    for m in (1, 2, 3, 9, 128):
        x = (torch.randn(m, 256, generator=g) * 3).to(torch.bfloat16)
        xr = dequantize_blocks(*quantize_blocks(x))
        ref = xr.double() @ w.T
        bound = 2.0**-8 * ref.abs() + 1e-6 * (xr.double().abs() @ w.abs().T)
        y = kern(x).double()
        assert ((y - ref).abs() - bound).max() <= 0, (spec, m)


@needs_a8
def test_dispatcher_offers_int8_activations_only_in_their_mode() -> None:
    from fewbits.formats.format import parse_format
    from fewbits.kernels.dispatch import choose_kernel

    fmt = parse_format("int4-g32")
    assert choose_kernel(fmt, (64, 256), "cpu", "16")[0] is Q4Kernel
    assert choose_kernel(fmt, (64, 256), "cpu", "int8")[0] is Q4Kernel  # W8A8 mode: int4 weights stay A16
    assert choose_kernel(fmt, (64, 256), "cpu", "q8")[0] is cpu_int4.Q4A8Kernel
    why = cpu_int4.Q4A8Kernel.supports(parse_format("int4-g16"), (64, 256))
    assert why is not None and "multiple of 32" in why
    assert choose_kernel(parse_format("int4-g16"), (64, 256), "cpu", "q8")[0] is Q4Kernel


@pytest.mark.parametrize("shape", [(16, 8), (48, 256), (64, 24)])
def test_unpack_codes_undoes_pack_codes(shape: tuple[int, int]) -> None:
    """The kernel gives its codes back exactly (a `QuantLinear` holds them only in the kernel): every code value
    in every nibble position of the chunks."""
    g = torch.Generator().manual_seed(shape[1])
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    codes[0, :8] = torch.arange(8, dtype=torch.uint8) + 8  # high codes in the nibbles that reach the sign bit
    assert torch.equal(cpu_int4.unpack_codes(cpu_int4.pack_codes(codes)), codes)
    # and packed as the quantised tensor stores 4-bit codes, straight from the chunks
    assert torch.equal(cpu_int4.row_packing(cpu_int4.pack_codes(codes)), pack_bits(codes, 4))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kernel_packed_codes_are_the_stored_packing(bits: int) -> None:
    """`Q4Kernel.packed_codes(bits)`, what a layer whose kernel holds its codes saves, is `pack_bits` of its codes."""
    fmt = parse_format(f"int{bits}-g32")
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits))
    qt = quantize_tensor(w, fmt)
    k = Q4Kernel(qt)
    assert torch.equal(k.packed_codes(bits), pack_bits(qt.unpacked_codes(), bits))
    assert torch.equal(k.packed_codes(bits), qt.codes)
