"""The cache eviction the probe runs between skeleton steps: the values stay, what cannot be evicted is refused."""

from __future__ import annotations

import pytest
import torch

from fewbits.bench import evict


def test_evict_keeps_every_value():
    if not evict.available():
        pytest.skip("the eviction operator is not built here (not x86, or no compiler)")
    t = torch.arange(10_000, dtype=torch.float32)
    ref = t.clone()
    run = evict.evictor([t, t[3:], torch.zeros(0)])  # a view that does not start on a line, an empty tensor
    assert run is not None
    run()
    assert torch.equal(t, ref)


def test_evictor_refuses_what_it_cannot_evict():
    assert evict.evictor([]) is None
    assert evict.evictor([torch.zeros(4, device="meta")]) is None
