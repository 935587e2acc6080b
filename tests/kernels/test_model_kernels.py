"""The dispatcher wired into a real model: SmolLM2-135M quantised with fast kernels gives the same
predictions as with the reference (dequantise + matmul) path, and decodes with them."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbits.api import quantize
from fewbits.eval.metrics import kl_per_token, log_probs
from fewbits.generate import generate
from fewbits.kernels import choose_kernel, prepare_linear
from fewbits.models.recipe import Recipe


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_fast_kernels_match_reference_path(smollm2):
    model, tok = smollm2
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog because it was")])
    for spec in ("int4-g64",):  # int8 is covered layer by layer
        m = copy.deepcopy(model)
        quantize(m, Recipe.from_format(spec), progress=False, chooser="reference")
        ref = log_probs(m(ids).logits[0])
        for mod in m.modules():  # same codes, fast kernels (bf16 activations)
            if hasattr(mod, "kernel"):
                mod.chooser = prepare_linear
                mod.kernel = prepare_linear(mod.qweight)
                assert mod.kernel.name == choose_kernel(spec, tuple(mod.qweight.shape))[0].name != "reference"
        fast = log_probs(m(ids).logits[0])
        kl = kl_per_token(ref, fast)
        assert float(kl.mean()) < 5e-3, spec  # bf16 activations vs fp32: measured 2.2e-3
        assert bool((ref.argmax(-1) == fast.argmax(-1)).float().mean() >= 0.9)
        res = generate(m, ids, 2)
        assert res.tokens.shape == (1, 2)
        del m
