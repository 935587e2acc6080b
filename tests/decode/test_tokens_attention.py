"""Why the compiled step's greedy tokens can equal the eager path's: one decode step's attention over a 16-bit
cache, compiled (`_attend_codes`), equals the eager path's attention (scaled-dot-product attention under
`attention_backends(decode=True)`, over the keys and values `KVStore.read` returns) to the last bf16 bit in
all but a few elements (fp32 sums taken in another order).  Over a quantised cache the compiled step folds the
scales out of its reductions (`fewbits.decode.kvkernel`, `LayerKV.scores`), so it agrees with the store's
bf16-dequantised values to rounding only (tests/decode/test_attend.py), not bit for bit.  Before, the eager
step ran the CPU flash kernel (probabilities rounded to bf16, an approximate exp): a third of the outputs
differed, and greedy tokens turned at near ties within a few dozen tokens (`benchmarks/bench_compiled.py tokens`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fewbits.decode.cache import make_cache
from fewbits.decode.runner import compile_scope
from fewbits.decode.step import _attend_codes
from fewbits.generate import attention_backends
from fewbits.kvcache.store import KVStore

B, HQ, HKV, D, N, SLOTS = 1, 6, 2, 64, 45, 64
SCALE = D**-0.5


@pytest.mark.parametrize("kv", ["bf16"])
def test_compiled_step_attention_is_the_eager_paths(kv: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(B, HKV, N + 1, D, generator=g) * torch.rand(1, 1, 1, D, generator=g) * 4).bfloat16()
    v = torch.randn(B, HKV, N + 1, D, generator=g).bfloat16()
    q = (torch.randn(B, HQ, 1, D, generator=g) * 2).bfloat16()

    store = KVStore(kv, B, HKV, D, SLOTS, dtype=torch.bfloat16)
    store.append(k[:, :, :N], v[:, :, :N])
    store.append(k[:, :, N:], v[:, :, N:])
    with attention_backends("cpu", decode=True):
        ref = F.scaled_dot_product_attention(q, *store.read(), scale=SCALE, enable_gqa=True)

    (layer,) = make_cache(kv, 1, B, HKV, D, SLOTS, torch.bfloat16, "cpu")
    layer.prefill(k[:, :, :N], v[:, :, :N], 0)
    allowed = torch.zeros(B, 1, SLOTS, dtype=torch.bool)
    allowed[:, :, : N + 1] = True

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        layer.step(k, v, slot)
        return _attend_codes(q, layer, allowed, slot, SCALE)

    with torch.no_grad(), compile_scope(tmp_path):
        got = torch.compile(step, fullgraph=True, dynamic=False)(q, k[:, :, N:], v[:, :, N:], torch.tensor([N]))

    differ = float((got != ref).float().mean())
    assert differ < 0.01, f"{differ:.1%} of the compiled attention's bf16 outputs differ from the eager path's"
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7 * float(ref.abs().max()))
