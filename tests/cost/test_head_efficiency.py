"""The 16-bit parts every weight format keeps (the LM head) stream at their own measured efficiency;
a profile without one keeps the 16-bit linears' efficiency, so its predictions do not change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT
from fewbits.cost.devices import get_device
from fewbits.cost.profile import Profile, ProfileError
from fewbits.cost.step import decode, kv_terms, weight_terms
from fewbits.models.presets import get_preset

SMOL = get_preset("smollm2-135m")


def _linear_time(prof: Profile, weights: str) -> tuple:
    dev = get_device("h100")
    w, kv = weight_terms(SMOL, weights, dev, prof), kv_terms(SMOL, "bf16", prof)
    return float(decode(SMOL, dev, prof, w, kv, 1, 128)["t_linear"]), w, dev


def test_profile_without_head_efficiency_predicts_as_before() -> None:
    assert DEFAULT.head_bandwidth_efficiency == 0 and DEFAULT.head_eff() == DEFAULT.bw_eff("float")
    old = Profile.from_dict({k: v for k, v in DEFAULT.to_dict().items() if k != "head_bandwidth_efficiency"})
    assert old.head_eff() == DEFAULT.bw_eff("float")
    assert _linear_time(old, "int4-g64")[0] == _linear_time(DEFAULT, "int4-g64")[0]


def test_quantised_model_head_streams_at_the_head_efficiency() -> None:
    prof = replace(DEFAULT, head_bandwidth_efficiency=0.9)
    t_new, w, dev = _linear_time(prof, "int4-g64")
    t_old = _linear_time(DEFAULT, "int4-g64")[0]
    # only the 16-bit parts (LM head 49152 x 576 bf16, norms, one embedding row) change rate: 0.8 -> 0.9
    dense = w.dense_f + w.emb_row
    assert dense > 49152 * 576 * 2
    assert t_old - t_new == pytest.approx(dense / dev.bandwidth * (1 / 0.8 - 1 / 0.9), rel=1e-9)
    assert w.eta_f == 0.9 and w.eta_w == DEFAULT.bw_eff("int4")


def test_head_efficiency_round_trips_and_is_validated() -> None:
    prof = replace(DEFAULT, head_bandwidth_efficiency=0.66)
    assert Profile.from_dict(prof.to_dict()).head_eff() == 0.66
    with pytest.raises(ProfileError, match="head_bandwidth_efficiency"):
        replace(DEFAULT, head_bandwidth_efficiency=1.5)
