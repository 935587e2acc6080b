"""The work between a step's matmuls at the model's widths (`Profile.width_overhead_s`, measured by `fewbits
probe`): L x (hidden + intermediate) x (w0 + w1 (b - 1)) seconds added to the step's fixed costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT, plan
from fewbits.cost.profile import Profile, ProfileError
from fewbits.models.presets import get_preset


def _profile(w0: float, w1: float) -> Profile:
    return replace(DEFAULT, name="w", width_overhead_s=w0, width_overhead_per_seq_s=w1)


@pytest.mark.parametrize("model,layers,width", [("smollm2-135m", 30, 576 + 1536), ("llama-3-8b", 32, 4096 + 14336)])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_the_term_is_layers_times_width_times_the_rate_at_the_batch(model, layers, width, batch):
    spec = get_preset(model)
    kw = dict(batch=batch, context=512, weights="int4-g64", kv="bf16", table_weights=None, table_kv=None)
    base, wide = plan(spec, profile=_profile(0.0, 0.0), **kw), plan(spec, profile=_profile(2e-12, 1e-12), **kw)
    added = layers * width * (2e-12 + 1e-12 * (batch - 1))
    assert wide.overhead_s - base.overhead_s == pytest.approx(added, rel=1e-9)
    assert wide.time_s - base.time_s == pytest.approx(added, rel=1e-9)
    assert wide.t_linear_s == base.t_linear_s and wide.t_attention_s == base.t_attention_s


def test_the_rates_round_trip_default_to_nothing_and_bad_ones_are_refused():
    p = _profile(2e-12, 1e-12)
    d = p.to_dict()
    assert (d["width_overhead_s"], d["width_overhead_per_seq_s"]) == (2e-12, 1e-12)
    back = Profile.from_dict(d)
    assert (back.width_overhead_s, back.width_overhead_per_seq_s) == (2e-12, 1e-12)
    old = {k: v for k, v in d.items() if not k.startswith("width_")}  # a profile from before the term
    assert Profile.from_dict(old).width_overhead_s == 0.0 == DEFAULT.width_overhead_per_seq_s
    for key in ("width_overhead_s", "width_overhead_per_seq_s"):
        for bad in (-1e-12, float("nan"), float("inf")):
            with pytest.raises(ProfileError, match=key):
                Profile.from_dict({**d, key: bad})
