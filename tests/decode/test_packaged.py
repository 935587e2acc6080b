"""The compiled step on the packaged models: its greedy tokens are the eager path's (16 here; the full 64 per
weight format in `benchmarks/bench_compiled.py tokens`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("name", "weights", "kv"), [("smollm2-135m", "int4-g32", "int8"),
                                                     ("gemma3-270m", "int4-g64", "bf16")])
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
    ref = generate(model, ids, 16, kv=kv).tokens
    dec = StaticDecoder(model, kv, 1, ids.shape[1] + 16, cache_dir=tmp_path)
    out = [dec.prefill(ids).argmax(-1)]
    for _ in range(15):
        out.append(dec.step(out[-1]).argmax(-1))
    assert torch.equal(torch.stack(out, 1), ref)
