"""The compiled step on a CUDA device (CUDA graphs, fewbits' Triton kernels inside them): the uncompiled step's
logits, teacher-forced with the eager path's greedy tokens, for 16-bit, int4 and int8 weights and a 16-bit and a
quantised cache.  Runs only where CUDA is present (`benchmarks/device_check.sh` runs it); the CPU step's own
tests are tests/decode/test_compiled.py, and the Triton kernels inside a compiled graph are checked through the
interpreter in CI (tests/kernels/test_triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch
from decode_models import build, teacher_forced_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("weights", "kv"), [("bf16", "bf16"), ("int4-g32", "bf16"), ("int8", "int8"),
                                             ("int4-g32", "int4-g8-r8")])
def test_compiled_cuda_step_equals_uncompiled(weights: str, kv: str, tmp_path) -> None:
    from fewbits.api import quantize
    from fewbits.kernels import prepare_linear
    from fewbits.models.recipe import Recipe

    model = build("llama", torch.bfloat16).cuda()
    if weights != "bf16":
        quantize(model, Recipe.from_format(weights, misfit="regroup"), progress=False, chooser=prepare_linear)
        kernels = {type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kernel")}
        assert kernels == {"TritonWeightOnlyKernel"}, kernels
    ids = torch.randint(4, 320, (1, 10), generator=torch.Generator().manual_seed(5)).cuda()
    got, want = teacher_forced_logits(model, kv, ids, 12, tmp_path)
    torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.0)
