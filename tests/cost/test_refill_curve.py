"""The measured core-cache refill curve: interpolated by hand-checked figures, validated, round-tripped."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fewbits.cost import DEFAULT
from fewbits.cost.profile import Profile, ProfileError
from fewbits.cost.step import refill_time
from fewbits.models.presets import get_preset

SMOL = get_preset("smollm2-135m")  # 30 layers
CURVE = ((1e6, 1e-4), (4e6, 3e-4))


def test_refill_curve_interpolates_from_zero_and_stays_flat_beyond_its_last_point() -> None:
    prof = replace(DEFAULT, cache_refill_s=2e-4, cache_refill_bytes=2e6, cache_refill_curve=CURVE)
    got = refill_time(SMOL, prof, np.array([0.5e6, 1e6, 2.5e6, 4e6, 1e7]))
    # 30 x (0.5e-4, 1e-4, 2e-4, 3e-4, 3e-4): the curve, not 30 x 2e-4 x min(1, x / 2e6)
    assert got == pytest.approx([1.5e-3, 3e-3, 6e-3, 9e-3, 9e-3], rel=1e-9)


def test_without_a_curve_the_ramp_to_the_l2_size_is_kept() -> None:
    prof = replace(DEFAULT, cache_refill_s=2e-4, cache_refill_bytes=2e6)
    got = refill_time(SMOL, prof, np.array([1e6, 4e6]))
    assert got == pytest.approx([3e-3, 6e-3], rel=1e-9)


def test_the_curve_changes_the_predicted_step_by_its_own_difference() -> None:
    """A step whose layers stream ~1.9 MB (int4-g64 SmolLM2) pays the curve's refill, not the ramp's."""
    from fewbits.cost import plan

    ramp = replace(DEFAULT, name="ramp", cache_refill_s=3e-4, cache_refill_bytes=2e6)
    curve = replace(ramp, name="curve", cache_refill_curve=CURVE)
    a = plan(SMOL, batch=1, context=132, weights="int4-g64", profile=ramp, table_weights=None, table_kv=None)
    b = plan(SMOL, batch=1, context=132, weights="int4-g64", profile=curve, table_weights=None, table_kv=None)
    # a layer streams its int4 weights (56.4 MB / 30) and 133 tokens of 16-bit keys and values
    x = 56_401_920 / 30 + 133 * 2 * 3 * 64 * 2  # 1,981,159 bytes
    ramp_s = 30 * 3e-4 * min(1.0, x / 2e6)  # 8.9 ms
    curve_s = 30 * (1e-4 + (x - 1e6) / 3e6 * 2e-4)  # 4.96 ms
    assert a.time_s - b.time_s == pytest.approx(ramp_s - curve_s, rel=1e-3)


def test_profile_curve_round_trips_and_rejects_bad_points() -> None:
    prof = replace(DEFAULT, name="c", cache_refill_curve=CURVE)
    back = Profile.from_dict(prof.to_dict())
    assert back.cache_refill_curve == CURVE
    with pytest.raises(ProfileError, match="cache_refill_curve"):
        replace(DEFAULT, cache_refill_curve=((4e6, 1e-4), (1e6, 3e-4)))  # bytes not increasing
    with pytest.raises(ProfileError, match="cache_refill_curve"):
        replace(DEFAULT, cache_refill_curve=((1e6, -1e-4),))
    with pytest.raises(ProfileError, match="cache_refill_curve"):
        Profile.from_dict({**prof.to_dict(), "cache_refill_curve": [[1e6]]})


def test_sweep_with_a_curve_matches_plan_point_by_point() -> None:
    """The curve broadcasts over the sweep's (weights, kv, batch, context) arrays."""
    from fewbits.cost import plan
    from fewbits.cost.sweep import sweep

    prof = replace(DEFAULT, name="curve", cache_refill_s=3e-4, cache_refill_bytes=2e6, cache_refill_curve=CURVE)
    res = sweep(SMOL, "h100", batch=(1, 8), context=(128, 2048), weights=("bf16", "int4-g64"), kv=("bf16",),
                profile=prof)
    for i, w in enumerate(("bf16", "int4-g64")):
        for j, b in enumerate((1, 8)):
            for k, c in enumerate((128, 2048)):
                one = plan(SMOL, "h100", b, c, w, profile=prof, table_weights=None, table_kv=None)
                assert res.time[i, 0, j, k] == pytest.approx(one.time_s, rel=1e-9)
