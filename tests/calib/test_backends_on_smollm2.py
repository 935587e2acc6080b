"""GPTQ's two calibration backends on the real packaged SmolLM2-135M: the plain-torch path (the one CUDA
takes) and the compiled CPU path quantise the first two decoder blocks (int4-g64, act-order, true-
sequential, so each block's Hessians depend on the blocks quantised before it) to the same codes, up to
rounding ties, and to the same mean KL to 3 decimals.  The whole model: benchmarks/bench_gptq_backends.py
(codes) and benchmarks/bench_methods.py with FEWBITS_CALIB_BACKEND set (KL)."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbits import api
from fewbits.methods.backend import ENV, numba_available
from fewbits.models.recipe import Recipe, Rule

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not numba_available(), reason="numba not installed")]


def test_both_backends_give_the_same_codes_and_kl(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    from fewbits.data.texts import load_texts
    from fewbits.data.tokens import token_windows

    model, tok = smollm2
    calib = torch.cat([token_windows(tok, t, 128, n_windows=4) for t in load_texts("calib", max_chars=40_000).values()])
    ev = torch.cat([token_windows(tok, t, 256, n_windows=1) for t in load_texts("eval", max_chars=20_000).values()])
    with torch.no_grad():
        ref = model(ev).logits.float().log_softmax(-1)
    codes, kl = {}, {}
    for be in ("torch", "numba"):
        monkeypatch.setenv(ENV, be)
        m = copy.deepcopy(model)
        api.quantize(m, Recipe((Rule(r"^model\.layers\.[01]\.", "int4-g64", "gptq", {}),)), calib, progress=False,
                     chooser="cached")
        codes[be] = {n: q.qweight.unpacked_codes() for n, q in m.named_modules() if hasattr(q, "qweight")}
        with torch.no_grad():
            logp = m(ev).logits.float().log_softmax(-1)
        kl[be] = float((ref.exp() * (ref - logp)).sum(-1).mean())
    assert len(codes["torch"]) == 14
    rows = sum(int((codes["torch"][n] != c).any(1).sum()) for n, c in codes["numba"].items())
    total = sum(c.shape[0] for c in codes["numba"].values())
    assert rows <= 0.01 * total, (rows, total)  # ties only (none with this project's CPU builds)
    assert abs(kl["torch"] - kl["numba"]) < 5e-4, kl  # equal to 3 decimals
