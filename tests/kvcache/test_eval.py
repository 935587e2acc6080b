"""KL of quantised KV caches against the 16-bit cache: zero for the reference, ordered by bits."""

from __future__ import annotations

import pytest
import torch

from fewbits.kvcache.eval import kv_cache_kl


def test_kl_ordering_tiny(tiny_llama):
    ids = torch.randint(4, 300, (1, 200), generator=torch.Generator().manual_seed(0))
    r = kv_cache_kl(tiny_llama, ids, ["bf16", "int8", "int4-r0", "int2-r0"], prefix=160, chunk=8)
    assert r["bf16"]["mean_kl"] == 0.0 and r["bf16"]["top1_agree"] == 1.0
    assert r["int8"]["mean_kl"] < r["int4-r0"]["mean_kl"] < r["int2-r0"]["mean_kl"]
    assert r["int8"]["n_eval"] == 40
    assert r["int2-r0"]["bytes_per_token"] < r["int8"]["bytes_per_token"] < r["bf16"]["bytes_per_token"]


def test_kl_bad_input(tiny_llama):
    with pytest.raises(ValueError, match="longer than prefix"):
        kv_cache_kl(tiny_llama, torch.zeros(1, 10, dtype=torch.long), ["int8"], prefix=10)


@pytest.mark.slow
def test_kl_smollm2_real_text(smollm2):
    """SmolLM2-135M on real prose, 256 tokens of context (the 2048+ figures come from the benchmark)."""
    from fewbits.data.texts import load_texts

    model, tok = smollm2
    text = load_texts("eval", ["prose"])["prose"]
    ids = torch.tensor([tok.encode(text)[:289]])
    r = kv_cache_kl(model, ids, ["int8", "int2-r0"], prefix=256, chunk=32, ref="fp32")
    assert r["int8"]["mean_kl"] < 0.01 and r["int8"]["top1_agree"] > 0.9
    assert r["int8"]["mean_kl"] < r["int2-r0"]["mean_kl"]
