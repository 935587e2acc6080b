"""A linear call's own work growing with the rows of x (`Profile.linear_call_per_seq_s`): the decode step adds
calls x that x (batch - 1) to its fixed costs, nothing at batch 1, and a profile without it predicts as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT
from fewbits.cost.devices import get_device
from fewbits.cost.profile import Profile, ProfileError
from fewbits.cost.step import decode, kv_terms, weight_terms
from fewbits.models.presets import get_preset

SMOL = get_preset("smollm2-135m")


def _step(prof: Profile, weights: str, batch: int) -> tuple[float, float]:
    dev = get_device("cpu")
    w, kv = weight_terms(SMOL, weights, dev, prof), kv_terms(SMOL, "bf16", prof)
    return float(decode(SMOL, dev, prof, w, kv, batch, 128)["t_overhead"]), w.linear_calls


@pytest.mark.parametrize("weights, fam", [("int8", "int8"), ("bf16", "float"), ("int4-g64", "int4")])
def test_each_call_pays_its_growth_per_extra_sequence(weights: str, fam: str) -> None:
    g = 6e-7
    prof = replace(DEFAULT, linear_call_per_seq_s={fam: g})
    for b in (1, 8, 32):
        t, calls = _step(prof, weights, b)
        t0, _ = _step(DEFAULT, weights, b)
        # SmolLM2: 30 layers x 7 linears (the model counts each projection a call), the LM head apart
        assert calls == 30 * 7
        assert t - t0 == pytest.approx(calls * g * (b - 1), rel=1e-9, abs=1e-15)
    # another family's growth does not touch this format
    other = replace(DEFAULT, linear_call_per_seq_s={"fp8": g})
    assert _step(other, weights, 8)[0] == _step(DEFAULT, weights, 8)[0]


def test_call_growth_round_trips_and_is_validated() -> None:
    prof = replace(DEFAULT, linear_call_per_seq_s={"int8": 6e-7})
    assert Profile.from_dict(prof.to_dict()).call_per_seq("int8") == 6e-7
    assert DEFAULT.call_per_seq("int8") == 0.0
    old = Profile.from_dict({k: v for k, v in DEFAULT.to_dict().items() if k != "linear_call_per_seq_s"})
    assert old.linear_call_per_seq_s == {}
    with pytest.raises(ProfileError, match="linear_call_per_seq_s"):
        replace(DEFAULT, linear_call_per_seq_s={"int3": 1e-7})
    with pytest.raises(ProfileError, match="not finite"):
        replace(DEFAULT, linear_call_per_seq_s={"int8": float("nan")})
