"""KV-cache formats: bytes by hand, reconstruction error bounds, quantise-on-every-write, model equivalence."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fewbits.formats.format import FormatError
from fewbits.kvcache import KVStore, parse_kv_format
from fewbits.kvcache.hf import QuantizedKVCache, cache_kwargs

B, H, D = 2, 3, 64

#: relative Frobenius error bounds for N(0, 1) keys/values (measured: fp8 0.025, int8 0.006,
#: int4 0.057 with half the tokens in the 16-bit window, int4-r0 0.077, int2-r0 0.39)
ERR = {"bf16": 4e-3, "fp8-e4m3": 0.035, "int8": 0.01, "int4-r0": 0.1, "int2-r0": 0.45}


def _kv(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bytes_per_token_by_hand():
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64; keys + values
    n = 30 * 3
    assert parse_kv_format("bf16").bytes_per_token(30, 3, 64) == n * 2 * 64 * 2  # 23040
    assert parse_kv_format("int8").bytes_per_token(30, 3, 64) == n * 2 * (64 + 2)  # codes + fp16 scale
    assert parse_kv_format("fp8-e4m3").bytes_per_token(30, 3, 64) == n * 2 * (64 + 2)
    # int4 KIVI, G=32: keys 32 B codes + 64 channels * 4 B / 32 tokens; values 32 B + 2 groups * 4 B
    assert parse_kv_format("int4").bytes_per_token(30, 3, 64) == n * ((32 + 8) + (32 + 8))
    assert parse_kv_format("int2").bytes_per_token(30, 3, 64) == n * ((16 + 8) + (16 + 8))


def test_max_context_fits_budget():
    for spec in ("bf16", "int8", "int4", "int2"):
        f = parse_kv_format(spec)
        budget = 1 << 30
        t = f.max_context(budget, 30, 3, 64)
        assert f.nbytes(t, 30, 3, 64) <= budget < f.nbytes(t + 1, 30, 3, 64)
    assert parse_kv_format("bf16").max_context(1 << 30, 30, 3, 64) == (1 << 30) // 23040


@pytest.mark.parametrize("spec", ["bad", "int3", "int8-g32", "bf16-r4", "int4-g32-g64"])
def test_bad_specs(spec):
    with pytest.raises(FormatError):
        parse_kv_format(spec)


def test_spec_roundtrip():
    for spec in ("bf16", "fp8-e4m3", "int8", "int4", "int2", "int2-g64-r16", "int8-r8"):
        assert parse_kv_format(spec).spec == spec


@pytest.mark.parametrize("spec", sorted(ERR))
def test_reconstruction_error_and_true_bytes(spec):
    k, v = _kv(96)
    st = KVStore(spec, B, H, D, 128, dtype=torch.float32)
    st.append(k[:, :, :64], v[:, :, :64])  # prefill
    for t in range(64, 96):  # decode steps, one token each
        st.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    kh, vh = st.read()
    assert kh.shape == k.shape and vh.shape == v.shape
    assert rel(kh, k) < ERR[spec] and rel(vh, v) < ERR[spec]
    f = parse_kv_format(spec)
    assert st.nbytes == f.nbytes(96, 1, H, D, B)


@pytest.mark.parametrize("spec,window", [("int8", 0), ("fp8-e4m3", 0), ("int4", (128, 160)),
                                         ("int2-g32-r16", (16, 48))])
def test_every_write_is_quantised_keys_included(spec, window):
    """Decode-time keys pass the quantiser: only the residual window (if any) stays 16-bit."""
    k, v = _kv(300, 1)
    st = KVStore(spec, B, H, D, 300, dtype=torch.float32)
    st.append(k[:, :, :10], v[:, :, :10])
    for t in range(10, 300):
        st.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if window == 0:
            assert st.n_res == 0 and st.n_quant == t + 1
    if window != 0:
        lo, hi = window
        assert lo <= st.n_res < hi and st.n_quant == 300 - st.n_res
    kh, _ = st.read()
    old = slice(0, st.n_quant)
    assert not torch.equal(kh[:, :, old], k[:, :, old])  # old keys really were quantised
    if st.n_res:
        assert rel(kh[:, :, st.n_quant:], k[:, :, st.n_quant:]) < 4e-3  # window is 16-bit


def test_prefill_equals_token_by_token_writes():
    k, v = _kv(200, 2)
    a = KVStore("int4", B, H, D, 256, dtype=torch.float32)
    b = KVStore("int4", B, H, D, 256, dtype=torch.float32)
    a.append(k, v)
    for t in range(200):
        b.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    for x, y in zip(a.read(), b.read(), strict=True):
        torch.testing.assert_close(x, y)


def test_store_errors():
    st = KVStore("int8", B, H, D, 8)
    k, v = _kv(9)
    with pytest.raises(ValueError, match="at most 8 tokens"):
        st.append(k, v)
    with pytest.raises(ValueError, match="cannot take keys"):
        st.append(k[:1, :, :2], v[:1, :, :2])
    with pytest.raises(FormatError, match="head dim"):
        KVStore("int4-g32", 1, 1, 48, 8)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_cache_in_model_matches_full_forward():
    m = _tiny_llama()
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    full = m(ids).logits
    for spec, tol in (("fp32", 1e-5), ("int8", 0.05), ("int4", 0.1)):
        cache = QuantizedKVCache(spec, 2, 64)
        kw = cache_kwargs(m, cache)  # the name this transformers takes (an unknown one is swallowed unused)
        parts = [m(ids[:, :40], **kw, use_cache=True).logits]
        for t in range(40, 48):
            parts.append(m(ids[:, t:t + 1], **kw, use_cache=True).logits)
        inc = torch.cat(parts, 1)
        assert rel(inc, full) < tol, spec
        assert cache.get_seq_length() == 48
        assert cache.nbytes == parse_kv_format(spec).nbytes(48, 2, 2, 32, 2)


def test_e4m3_bit_move_is_exact_for_every_code():
    from fewbits.kvcache.quant import e4m3_as_bf16_bits

    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    ok = ~torch.isnan(ref)
    got = e4m3_as_bf16_bits(codes).float() * 2.0**120
    torch.testing.assert_close(got[ok], ref[ok], rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["fp8-e4m3", "int8", "int4", "int2-r0"])
def test_bf16_read_path_matches_fp32_path(spec):
    """The 16-bit dequantisation shortcuts agree with fp32 arithmetic to bf16 rounding."""
    k, v = _kv(200, 5)
    a = KVStore(spec, B, H, D, 256, dtype=torch.float32)
    b = KVStore(spec, B, H, D, 256, dtype=torch.bfloat16)
    a.append(k.bfloat16().float(), v.bfloat16().float())
    b.append(k.bfloat16(), v.bfloat16())
    for x, y in zip(a.read(), b.read(), strict=True):
        assert y.dtype == torch.bfloat16
        assert rel(y.float(), x) < 8e-3


def test_cache_kwargs_follow_the_models_forward():
    """A model whose forward names its cache `past_key_values` (transformers before `cache`) must get it
    under that name: it would swallow `cache=` unused and run without a cache."""
    cache = QuantizedKVCache("int8", 2, 8)

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):  # noqa: ANN001, ANN003
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):  # noqa: ANN001, ANN003
            return cache

    assert cache_kwargs(Old(), cache) == {"past_key_values": cache}
    assert cache_kwargs(New(), cache) == {"cache": cache}
    assert Old()(None, **cache_kwargs(Old(), cache)) is cache
