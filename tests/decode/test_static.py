"""The static-cache step (uncompiled here) gives the eager decode's greedy tokens for every family and KV
format: the eager path (`fewbits.generate`, transformers' own forward over `KVStore`) is the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from decode_models import build

from fewbits.decode.arch import describe, unsupported
from fewbits.decode.runner import StaticDecoder
from fewbits.generate import generate

# formats whose windows and groups flush several times within the test's 40 tokens
KV_FORMATS = ["fp32", "bf16", "int8", "fp8-e4m3", "int8-r8", "int4-g8-r8", "int2-g8-r4"]


def static_tokens(model: torch.nn.Module, ids: torch.Tensor, n: int, kv: str, mask: torch.Tensor | None = None,
                  compile: bool = False) -> torch.Tensor:
    dec = StaticDecoder(model, kv, ids.shape[0], ids.shape[1] + n, compile=compile)
    out = [dec.prefill(ids, mask).argmax(-1)]
    for _ in range(n - 1):
        out.append(dec.step(out[-1]).argmax(-1))
    return torch.stack(out, 1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_family_matches_eager(family: str) -> None:
    family_model = build(family)
    ids = torch.randint(4, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = generate(family_model, ids, 20, kv="fp32").tokens
    assert torch.equal(static_tokens(family_model, ids, 20, "fp32"), ref)


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kv_formats_match_eager(family: str, kv: str) -> None:
    model = build(family)
    ids = torch.randint(4, 320, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = generate(model, ids, 32, kv=kv).tokens
    assert torch.equal(static_tokens(model, ids, 32, kv), ref)


def test_left_padding_matches_eager() -> None:
    model = build("llama")
    ids = torch.randint(4, 320, (2, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    ref = generate(model, ids, 12, kv="int8", attention_mask=mask).tokens
    assert torch.equal(static_tokens(model, ids, 12, "int8", mask), ref)


def test_architecture_read_off_the_modules() -> None:
    arch = describe(build("gemma3"))
    assert arch.sandwich and [p.window for p in arch.layers] == [8, None, 8]
    assert arch.rope_keys == ("sliding_attention", "full_attention")
    assert arch.layers[0].scaling == pytest.approx(32 ** -0.5)
    assert not describe(build("llama")).sandwich


def test_unsupported_model_says_why() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in unsupported(model)
    with pytest.raises(ValueError, match="gpt2"):
        StaticDecoder(model, "bf16", 1, 8, compile=False)


def test_cache_full_is_refused() -> None:
    model = build("llama")
    dec = StaticDecoder(model, "bf16", 1, 4, compile=False)
    with pytest.raises(ValueError, match="does not fit"):
        dec.prefill(torch.ones(1, dec.max_len, dtype=torch.long))


@pytest.mark.parametrize("kv", ["int8", "fp8-e4m3", "int8-r8", "int4-g8-r8", "int2-g8-r4"])
def test_attention_over_codes_equals_dequantised_attention(kv: str) -> None:
    """The compiled step's attention (scale and minimum folded into reductions over the codes, the 16-bit
    ring beside them) against softmax attention over the dequantised history `LayerKV.dense` returns."""
    from fewbits.decode.cache import make_cache
    from fewbits.decode.step import _attend_codes

    g = torch.Generator().manual_seed(4)
    B, H, Hq, D, n = 2, 2, 4, 32, 21
    (layer,) = make_cache(kv, 1, B, H, D, 32, torch.float32, "cpu")
    layer.prefill(torch.randn(B, H, 13, D, generator=g), torch.randn(B, H, 13, D, generator=g), 0)
    for t in range(13, n):
        layer.step(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g), torch.tensor([t]))
    q = torch.randn(B, Hq, 1, D, generator=g)
    allowed = torch.zeros(B, 1, layer.t["kc"].shape[2], dtype=torch.bool)
    allowed[:, :, :n] = True
    allowed[1, :, :3] = False  # a left-padded row
    got = _attend_codes(q, layer, allowed, torch.tensor([n - 1]), 0.3)
    k, v = layer.dense(n, torch.float32)
    s = torch.einsum("bhrd,bhtd->bhrt", q.view(B, H, 2, D), k) * 0.3
    s = s.masked_fill(~allowed[:, :, None, :n], float("-inf"))
    want = torch.einsum("bhrt,bhtd->bhrd", s.softmax(-1), v).reshape(B, Hq, 1, D)
    # int8 without a window, D a multiple of 16: on an AVX2 or AVX-512 CPU the kernel rounds the query and the
    # weights to int16 (steps of 2^-15 of their largest; seen here: 5.6e-5 at most, rms 1.6e-5, where the int8 codes
    # themselves are off the unquantised history's attention by rms 4.1e-3); the other caches' paths here are float
    tol = 1e-4 if kv == "int8" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_cache_slots_are_few_counts_where_attention_reads_only_written_slots() -> None:
    from fewbits.decode import kvkernel
    from fewbits.decode.runner import cache_slots
    from fewbits.kvcache.format import parse_kv_format

    if not kvkernel.available():
        pytest.skip("the CPU attention operators need a C++ compiler")
    for kv in ("bf16", "int8", "int4-g8-r8", "fp8-e4m3"):
        f = parse_kv_format(kv)
        assert [cache_slots(t, f, "cpu") for t in (1, 71, 207, 256, 257, 2100)] == [256, 256, 256, 256, 512, 4096]
    # inductor's reductions read every slot: an fp8 cache with a window on a CPU, any cache off the CPU
    for kv, device in (("fp8-e4m3-r8", "cpu"), ("bf16", "meta")):
        f = parse_kv_format(kv)
        assert [cache_slots(t, f, device) for t in (1, 71, 207, 257, 2100)] == [64, 128, 256, 320, 2112]
    with pytest.raises(ValueError, match="at least one slot"):
        cache_slots(0, parse_kv_format("bf16"), "cpu")


def test_generate_with_another_length_in_the_bucket_reuses_the_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fewbits generate` with a 7-token prompt and -n 64, then -n 200: one compiled step, not two."""
    import fewbits.decode.generate as dg
    from fewbits.decode import kvkernel

    if not kvkernel.available():
        pytest.skip("the CPU attention operators need a C++ compiler")
    built: list[tuple] = []

    def record(model, kv, batch, max_len):  # noqa: ANN001, ANN202 - stands in for the compile
        built.append((kv.full_spec, batch, max_len))
        return SimpleNamespace(compile_s=30.0)

    monkeypatch.setattr(dg, "StaticDecoder", record)
    model = build("llama")
    a = dg.decoder_for(model, "int8", 1, 7 + 64)
    assert dg.decoder_for(model, "int8", 1, 7 + 200) is a and len(built) == 1
    assert dg.decoder_for(model, "int8", 1, 7 + 300) is not a and len(built) == 2
    assert dg.decoder_for(model, "fp8-e4m3-r8", 1, 7 + 64) is not dg.decoder_for(model, "fp8-e4m3-r8", 1, 7 + 200)


def test_a_compiler_failure_falls_back_to_eager_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import fewbits.decode.generate as dg

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("inductor: no such compiler\nmore")

    monkeypatch.setattr(dg, "StaticDecoder", broken)
    model = build("llama")
    ids = torch.randint(4, 320, (1, 6), generator=torch.Generator().manual_seed(6))
    res = dg.generate_static(model, ids, 5, kv="int8")
    assert res.path == "eager" and res.eager_reason == ("compiling the step failed (RuntimeError: inductor: no such "
                                                        "compiler)")
    assert torch.equal(res.tokens, generate(model, ids, 5, kv="int8").tokens)
    monkeypatch.setenv("FEWBITS_EAGER", "1")
    assert dg.generate_static(model, ids, 5).eager_reason == "FEWBITS_EAGER=1"
