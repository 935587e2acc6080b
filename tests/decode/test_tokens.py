"""64 greedy tokens of the compiled step equal the eager path's (`fewbits.generate.generate`: transformers' own
forward over fewbits' `KVStore`) on the packaged models, for a 16-bit and a quantised model, a 16-bit and a
quantised KV cache.  The compiled step's attention computes in fp32 what the eager step's math attention computes, over
the keys and values the eager path reads; a 16-bit model's greedy tokens pass near ties (top two logits one
bf16 step apart, or equal) often enough within 64 tokens that any rounding difference there shows.

Slow: each case compiles a graph (~1 min cold on two cores).  The full table over weight and KV formats for
both packaged models is `benchmarks/bench_compiled.py tokens`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

N = 64


# rows of `bench_compiled.py tokens` measured 64/64; SmolLM2 bf16 with a bf16 cache is not here: its eager logits
# tie exactly (bf16) at token 6, and the compiled step's fp32 sums, in another order, break the tie the other way
CASES = [("smollm2-135m", "bf16", "int8"), ("gemma3-270m", "int4-g64", "bf16")]


@pytest.mark.parametrize(("name", "weights", "kv"), CASES)
def test_compiled_greedy_tokens_equal_eager(name: str, weights: str, kv: str, request: pytest.FixtureRequest,
                                            tmp_path: Path) -> None:
    from fewbits.bench.decode import load_quantized
    from fewbits.decode.runner import StaticDecoder
    from fewbits.generate import generate
    from fewbits.models.loading import load_model

    request.getfixturevalue("smollm2_dir" if name.startswith("smollm2") else "gemma3_dir")
    tok = load_model(name, dtype="bf16")[1]
    model = load_quantized(name, weights)[0]
    ids = tok("The history of the printing press begins in", return_tensors="pt").input_ids
    ref = generate(model, ids, N, kv=kv).tokens
    dec = StaticDecoder(model, kv, 1, ids.shape[1] + N, cache_dir=tmp_path)
    assert dec.compiled and dec.compile_s > 0
    out = [dec.prefill(ids).argmax(-1)]
    for _ in range(N - 1):
        out.append(dec.step(out[-1]).argmax(-1))
    got = torch.stack(out, 1)
    same = int((got == ref).long().cumprod(1).sum())
    assert same == N, f"compiled greedy tokens leave the eager path's at token {same} of {N}"
