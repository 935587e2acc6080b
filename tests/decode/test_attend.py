"""Decode attention over a quantised cache (`fewbits.decode.step._attend_codes`): the hand-written kernel
(`fewbits.decode.kvkernel`) and the pure-torch folded reductions, eager and compiled, against softmax
attention over the history dequantised by `fewbits.kvcache.quant` (`LayerKV.dense`)."""

from __future__ import annotations

import pytest
import torch

from fewbits.decode import kvkernel
from fewbits.decode.cache import make_cache
from fewbits.decode.step import _attend_codes
from fewbits.kernels import native

needs_kernel = pytest.mark.skipif(not kvkernel.available(), reason=f"no kernel: {native.why(kvkernel.NAME)}")


def filled(kv: str, D: int, n: int, H: int = 2, B: int = 2, seed: int = 4, spare: int = 8):  # noqa: ANN201
    """A layer holding n tokens, the last 8 (or fewer) written one step at a time (the window wraps), in a cache of
    n + `spare` slots."""
    g = torch.Generator().manual_seed(seed)
    (layer,) = make_cache(kv, 1, B, H, D, n + spare, torch.bfloat16, "cpu")
    first = max(1, n - 8)
    k, v = torch.randn(B, H, first, D, generator=g), torch.randn(B, H, first, D, generator=g)
    layer.prefill(k.bfloat16(), v.bfloat16(), 0)
    for t in range(first, n):
        layer.step(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g), torch.tensor([t]))
    return layer


def reference(layer, q: torch.Tensor, allowed: torch.Tensor, n: int, scale: float) -> torch.Tensor:  # noqa: ANN001
    """Softmax attention over the dequantised history, each KV head shared by Hq / Hkv query heads."""
    B, Hq, _, D = q.shape
    k, v = layer.dense(n, torch.float32)
    H = k.shape[1]
    s = torch.einsum("bhrd,bhtd->bhrt", q.float().view(B, H, Hq // H, D), k) * scale
    s = s.masked_fill(~allowed[:, :, None, :n], float("-inf"))
    return torch.einsum("bhrt,bhtd->bhrd", s.softmax(-1), v).reshape(B, Hq, 1, D)


def slots(layer) -> int:  # noqa: ANN001
    return layer.t["k" if layer.fmt.kind == "float" else "kc"].shape[2]


def mask(layer, B: int, n: int) -> torch.Tensor:  # noqa: ANN001
    allowed = torch.zeros(B, 1, slots(layer), dtype=torch.bool)
    allowed[:, :, :n] = True
    allowed[1, :, :3] = False  # a left-padded row
    return allowed


# D = 64: KIVI whose value groups span whole 8-byte blocks of codes (int4-g16/g32, int2-g32/g64) takes the 16-bit
# integer path in both builds; the 512-bit fp32 path the other KIVI caches (g8: value scales picked per lane) and
# int8 with a window (its scales folded into the weights); the 256-bit fp32 path int8 with a window; the plain loops
# the rest (D = 16 / 24, g8 on AVX2).  Windows that wrap (int8-r8, int4-g8-r8: 16-slot rings, 8 steps),
# KIVI's default g32-r128 at 300 tokens, GQA 3, 1 and 5 (query heads four at a time: a partial second tile).
# 16-bit caches (`attend_rows`): several chunks of CHUNK_ROWS with a partial last one, D = 24 (no whole 512-bit
# vectors), D = 20 (no whole 256-bit ones either), fp16.
CASES = [("bf16", 64, 300, 3), ("bf16", 24, 30, 2), ("bf16", 20, 30, 2), ("fp16", 128, 100, 5),
         ("int8", 64, 300, 3), ("int8-r8", 64, 41, 3), ("int4-g8-r8", 64, 41, 3), ("int2-g8-r4", 64, 37, 1),
         ("int4", 64, 300, 3), ("int2", 64, 300, 3), ("int4-g8-r8", 16, 41, 2), ("int2-g8-r4", 24, 29, 3),
         ("int8", 24, 30, 2), ("int2-g64-r16", 64, 200, 5), ("int4-r16", 128, 100, 4), ("int4-g16-r8", 64, 41, 3),
         ("fp8-e4m3", 64, 300, 3), ("fp8-e4m3", 24, 30, 2)]


@needs_kernel
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kv,D,n,r", CASES)
def test_kernel_equals_dequantised_attention(kv: str, D: int, n: int, r: int, build: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The main build, and the 256-bit vector paths (built without AVX-512 where the main build has it)."""
    if build == "avx2":
        ops = _rows_ops("avx2")
        if ops is torch.ops.fewbits_kv:
            pytest.skip("the main build is the AVX2 one")
        for op in ("attend_kv", "attend_rows"):
            monkeypatch.setattr(torch.ops.fewbits_kv, op, getattr(ops, op))
    layer = filled(kv, D, n)
    assert layer.kernel
    q = torch.randn(2, 2 * r, 1, D, generator=torch.Generator().manual_seed(7)).bfloat16()
    allowed = mask(layer, 2, n)
    got = _attend_codes(q, layer, allowed, torch.tensor([n - 1]), D**-0.5)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), reference(layer, q, allowed, n, D**-0.5), rtol=1e-2, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kv,D,n,r", [("int4", 64, 300, 3), ("int2", 64, 300, 3), ("int4-g16-r8", 64, 41, 3),
                                      ("int4-r16", 128, 100, 4), ("int2-g64-r16", 64, 200, 5),
                                      ("int4-r16", 96, 100, 3),  # three value groups a token (not a power of 2)
                                      ("fp8-e4m3", 64, 300, 3), ("int8", 64, 300, 3)])
def test_kernel_in_fp32_is_close_to_dequantised_attention(kv: str, D: int, n: int, r: int, build: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 query (an fp32 result, no bf16 rounding at the end): the KIVI vector paths agree with attention
    over the dequantised history to 1e-3, a quarter of one bf16 step at 1.0 (the fp32 paths to ~1e-5; the
    integer path, in both builds, rounds the scaled query and the softmax weights to int16 steps of 2^-15 of their
    largest: seen here up to 3e-4)."""
    if build == "avx2":
        ops = _rows_ops("avx2")
        if ops is torch.ops.fewbits_kv:
            pytest.skip("the main build is the AVX2 one")
        monkeypatch.setattr(torch.ops.fewbits_kv, "attend_kv", ops.attend_kv)
        monkeypatch.setattr(torch.ops.fewbits_kv, "attend_rows", ops.attend_rows)
    layer = filled(kv, D, n)
    assert layer.kernel
    q = torch.randn(2, 2 * r, 1, D, generator=torch.Generator().manual_seed(7)) * 2
    allowed = mask(layer, 2, n)
    got = _attend_codes(q, layer, allowed, torch.tensor([n - 1]), D**-0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(layer, q, allowed, n, D**-0.5), rtol=1e-3, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("kv", ["int4", "int8-r8", "int4-g8-r8"])
def test_kernel_reads_only_the_written_slots_of_a_larger_cache(kv: str) -> None:
    """A cache of 1300 slots holding 300 tokens (`fewbits generate` preallocates prompt + new tokens): the slots
    past the written ones hold NaN scales and 16-bit NaNs, which no unit may read (the operator cuts its units at
    the quantised tokens, not at the cache's end), and the result equals attention over the 300 tokens."""
    n = 300
    layer = filled(kv, 64, n, spare=1000)
    for name, buf in layer.t.items():
        if name in ("ks", "km", "vs", "vm"):  # (KIVI's key scales and minima: one row a group)
            per_group = name in ("ks", "km") and layer.fmt.kind == "kivi"
            buf[:, :, -(-n // layer.G) if per_group else n:] = float("nan")
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    allowed = mask(layer, 2, n)
    got = _attend_codes(q, layer, allowed, torch.tensor([n - 1]), 0.125)
    torch.testing.assert_close(got.float(), reference(layer, q, allowed, n, 0.125), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kv,D,n,r", CASES[:9])
def test_torch_reductions_equal_dequantised_attention(kv: str, D: int, n: int, r: int) -> None:
    """The fallback (scales folded out of inductor-fused reductions) where the kernel is not built."""
    layer = filled(kv, D, n)
    layer.kernel = False
    q = torch.randn(2, 2 * r, 1, D, generator=torch.Generator().manual_seed(7))
    allowed = mask(layer, 2, n)
    got = _attend_codes(q, layer, allowed, torch.tensor([n - 1]), D**-0.5)
    torch.testing.assert_close(got, reference(layer, q, allowed, n, D**-0.5), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kv", ["int8-r8", "int4-g8-r8", "bf16", "fp8-e4m3"])
def test_compiled_kernel_step_equals_reference(kv: str) -> None:
    """The operator inside a compiled step (cache write + attention, one graph), slot after slot."""
    torch._dynamo.reset()
    D, B = 64, 2
    layer = filled(kv, D, 20)
    allowed = torch.zeros(B, 1, slots(layer), dtype=torch.bool)

    def step(q, k, v, slot):  # noqa: ANN001, ANN202
        layer.step(k, v, slot)
        return _attend_codes(q, layer, allowed, slot, 0.125)

    fn = torch.compile(step, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(8)
    for t in range(20, 27):  # groups flush out of the window on the way
        allowed[:, :, : t + 1] = True
        q = torch.randn(B, 6, 1, D, generator=g).bfloat16()
        k, v = torch.randn(B, 2, 1, D, generator=g).bfloat16(), torch.randn(B, 2, 1, D, generator=g).bfloat16()
        got = fn(q, k, v, torch.tensor([t]))
        torch.testing.assert_close(got.float(), reference(layer, q, allowed, t + 1, 0.125), rtol=1e-2, atol=1e-2)


def test_without_a_compiler_the_torch_path_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native._BUILT, kvkernel.NAME, False)
    layer = filled("int4-g8-r8", 32, 30)
    assert not layer.kernel
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(9))
    allowed = mask(layer, 2, 30)
    torch.testing.assert_close(_attend_codes(q, layer, allowed, torch.tensor([29]), 0.2),
                               reference(layer, q, allowed, 30, 0.2), rtol=1e-5, atol=1e-5)


def _int8_rows(g: torch.Generator, shape: tuple[int, ...], key_scales: tuple[float, float] = (0.02, 0.001)
               ) -> tuple[torch.Tensor, ...]:
    """int8 key and value codes of `shape` with fp16 per-token scales (keys' uniform in [b, a + b) for
    key_scales (a, b), values' in [0.001, 0.021)), and the values they stand for in fp32: k, v, ks, vs, kf, vf."""
    B, H, T, _ = shape
    k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    ks = (torch.rand(B, H, T, 1, generator=g) * key_scales[0] + key_scales[1]).half()
    vs = (torch.rand(B, H, T, 1, generator=g) * 0.02 + 0.001).half()
    return k, v, ks, vs, k.float() * ks.float(), v.float() * vs.float()


def _rows_ops(build: str):  # noqa: ANN202
    if build == "native":
        return torch.ops.fewbits_kv
    flags = set(native.cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    if "avx512f" not in flags:
        return torch.ops.fewbits_kv  # the main build is the AVX2 one
    if not kvkernel.build_avx2():
        pytest.skip(f"no build without AVX-512: {native.why(kvkernel.AVX2_NAME)}")
    return torch.ops.fewbits_kv_avx2


@needs_kernel
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.uint8])
@pytest.mark.parametrize(("D", "R", "T", "chunk"), [(64, 3, 300, 64), (40, 3, 300, 64), (96, 5, 300, 64),
                                                     (64, 4, 1300, 1024), (64, 3, 300, 300)])
def test_attend_rows_equals_softmax_attention(build: str, dtype: torch.dtype, D: int, R: int, T: int,
                                              chunk: int) -> None:
    """`attend_rows` called directly, on the main build and on the build without AVX-512 (the 256-bit path):
    softmax attention over slots 0..slot of whole rows (int8 codes, or E4M3 codes as uint8, times their per-token
    scales), masked slots and the slots after the query's own never read (they hold NaN here).  int8 with D a
    multiple of 16 takes the 16-bit integer path in both builds (VNNI's 512-bit one where D is a multiple of 32 on
    a CPU that has it): D = 96 (there a pass of 32 channels after one of 64), five query heads (a pass of four,
    then one), an odd count of tokens in a chunk, and chunks asked of 1024 tokens (cut to 512: exact int32 sums);
    chunks of 300 tokens: one unit holds all the slots of a (b, h), whose thread writes its output (no merge)."""
    ops = _rows_ops(build)
    g = torch.Generator().manual_seed(D)
    B, H, slot = 2, 2, T - 40
    q = torch.randn(B, H, R, D, generator=g).bfloat16()
    if dtype == torch.int8:
        k, v, ks, vs, kf, vf = _int8_rows(g, (B, H, T, D))
    elif dtype == torch.uint8:  # E4M3 codes: every finite one (subnormals too), NaN after the slot
        finite = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        finite = finite[torch.isfinite(finite.view(torch.float8_e4m3fn).float())]
        k = finite[torch.randint(0, finite.numel(), (B, H, T, D), generator=g)]
        v = finite[torch.randint(0, finite.numel(), (B, H, T, D), generator=g)]
        k[:, :, slot + 1:], v[:, :, slot + 1:] = 0x7F, 0x7F
        ks = (torch.rand(B, H, T, 1, generator=g) * 0.005 + 0.0005).half()
        vs = (torch.rand(B, H, T, 1, generator=g) * 0.005 + 0.0005).half()
        kf = k.view(torch.float8_e4m3fn).float() * ks.float()
        vf = v.view(torch.float8_e4m3fn).float() * vs.float()
    else:
        k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
        k[:, :, slot + 1:] = float("nan")
        v[:, :, slot + 1:] = float("nan")
        ks = vs = torch.empty(0)
        kf, vf = k.float(), v.float()
    allowed = torch.ones(B, T, dtype=torch.bool)
    allowed[1, :5] = False  # a left-padded row
    scale = D**-0.5
    got = ops.attend_rows(q, scale, k, v, ks, vs, allowed, torch.tensor([slot]), chunk)
    s = torch.einsum("bhrd,bhtd->bhrt", q.float(), kf[:, :, :slot + 1]) * scale
    s = s.masked_fill(~allowed[:, None, None, :slot + 1], float("-inf"))
    ref = torch.einsum("bhrt,bhtd->bhrd", s.softmax(-1), vf[:, :, :slot + 1])
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref, rtol=4e-3, atol=1e-3)  # (the output rounded to bf16: 2^-9)


@needs_kernel
def test_attend_rows_int8_sums_stay_exact_over_long_chunks() -> None:
    """Uniform attention (a zero query) over 1300 tokens of int8 codes of 127 with chunks asked of 1024: the
    integer path's weights are all its largest int16 and its sums would pass 2^31 past 516 tokens a chunk, so it
    cuts chunks to 512; every path must return the codes' value exactly (to bf16)."""
    B, H, R, T, D = 1, 1, 2, 1300, 64
    q = torch.zeros(B, H, R, D).bfloat16()
    k = torch.randint(-127, 128, (B, H, T, D), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    v = torch.full((B, H, T, D), 127, dtype=torch.int8)
    ks = vs = torch.full((B, H, T, 1), 0.01).half()
    got = torch.ops.fewbits_kv.attend_rows(q, 0.125, k, v, ks, vs, torch.ones(B, T, dtype=torch.bool),
                                           torch.tensor([T - 1]), 1024)
    assert torch.equal(got, torch.full_like(got, 127 * float(vs[0, 0, 0, 0])))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_attend_rows_peaked_scores_match_softmax_and_leave_no_denormal_mode(dtype: torch.dtype) -> None:
    """A very peaked head: most scores 87 or more below the largest, so their softmax weights would be denormals,
    which the operator flushes to zero (they ran ~15x slower); the result is still softmax attention, and the
    caller's floating-point mode is restored (a denormal survives a product afterwards)."""
    g = torch.Generator().manual_seed(1)
    B, H, R, T, D = 2, 3, 3, 600, 64
    q = torch.randn(B, H, R, D, generator=g).bfloat16()
    if dtype == torch.int8:
        k, v, ks, vs, kf, vf = _int8_rows(g, (B, H, T, D), key_scales=(0.5, 0.1))
    else:
        k, v = (torch.randn(B, H, T, D, generator=g) * 30).bfloat16(), torch.randn(B, H, T, D, generator=g).bfloat16()
        ks = vs = torch.empty(0)
        kf, vf = k.float(), v.float()
    s = torch.einsum("bhrd,bhtd->bhrt", q.double(), kf.double()) * 0.125
    assert ((s.amax(-1, keepdim=True) - s) > 87).double().mean() > 0.5  # most weights below fp32's normal range
    got = torch.ops.fewbits_kv.attend_rows(q, 0.125, k, v, ks, vs, torch.ones(B, T, dtype=torch.bool),
                                           torch.tensor([T - 1]), 64)
    ref = torch.einsum("bhrt,bhtd->bhrd", s.softmax(-1), vf.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)
    tiny = torch.tensor([1e-38], dtype=torch.float32)
    assert float(tiny * 0.5) > 0  # the mode is back: a denormal product, not flushed


@needs_kernel
def test_attend_rows_reads_a_sliced_mask_and_refuses_a_slot_not_int64() -> None:
    """The mask may be a slice of a longer one (the step's (B, 1, cache + more)[..., :T]: not contiguous); the
    slot must be one int64 on the CPU (it is read from memory, not converted), and another dtype is named."""
    g = torch.Generator().manual_seed(0)
    B, H, R, T, D = 2, 1, 2, 40, 16
    q = torch.randn(B, H, R, D, generator=g).bfloat16()
    k, v = torch.randn(B, H, T, D, generator=g).bfloat16(), torch.randn(B, H, T, D, generator=g).bfloat16()
    long_mask = torch.ones(B, 1, T + 24, dtype=torch.bool)
    long_mask[1, :, :3] = False
    sliced = long_mask[:, :, :T]
    assert not sliced.is_contiguous()
    e, slot = torch.empty(0), torch.tensor([30])
    got = torch.ops.fewbits_kv.attend_rows(q, 0.25, k, v, e, e, sliced, slot, 8)
    assert torch.equal(got, torch.ops.fewbits_kv.attend_rows(q, 0.25, k, v, e, e, sliced.contiguous(), slot, 8))
    s = torch.einsum("bhrd,bhtd->bhrt", q.float(), k[:, :, :31].float()) * 0.25
    s = s.masked_fill(~sliced[:, :, None, :31], float("-inf"))
    torch.testing.assert_close(got.float(), torch.einsum("bhrt,bhtd->bhrd", s.softmax(-1), v[:, :, :31].float()),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="slot must be one int64"):
        torch.ops.fewbits_kv.attend_rows(q, 0.25, k, v, e, e, sliced, slot.int(), 8)
