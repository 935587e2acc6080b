"""A profile whose skeleton steps found a small batch reading its cache slower per byte than a large one
(`Profile.kv_batch_factor`, fitted by `fewbits probe`): the cache's time at a batch is its bytes at the largest
batch's efficiency, x the factor interpolated in log batch (flat outside the measured batches)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fewbits.cost import DEFAULT, plan
from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import Profile, ProfileError
from fewbits.models.presets import get_preset

CPU = DeviceSpec(key="cpu2", name="2-core CPU", memory_bytes=24e9, bandwidth=28.4e9,
                 peak_flops={"bf16": 357e9, "fp32": 357e9})


def _profile(factor: tuple[tuple[float, float], ...]) -> Profile:
    return replace(DEFAULT, name="cpu2", kv_bandwidth_efficiency={**DEFAULT.kv_bandwidth_efficiency, "float": 0.73},
                   overhead_s=0.0, kv_compute_measured=True, kv_batch_factor=factor, device=CPU)


def test_the_scale_interpolates_in_log_batch_and_is_flat_outside() -> None:
    p = _profile(((1.0, 1.5), (8.0, 1.0)))
    assert p.kv_batch_scale(1) == 1.5 and p.kv_batch_scale(8) == 1.0 and p.kv_batch_scale(64) == 1.0
    assert p.kv_batch_scale(math.sqrt(8)) == pytest.approx(1.25)  # halfway in log batch
    assert p.kv_batch_scale(2) == pytest.approx(1.5 - 0.5 / 3)
    got = p.kv_batch_scale(np.array([1.0, 2.0, 8.0, 32.0]))
    assert isinstance(got, np.ndarray) and got.tolist() == pytest.approx([1.5, 1.5 - 0.5 / 3, 1.0, 1.0])
    assert _profile(()).kv_batch_scale(1) == 1.0 and DEFAULT.kv_batch_scale(np.array([1, 8])).tolist() == [1, 1]


@pytest.mark.parametrize("kv", ["bf16", "int8-r0", "int4-g32-r128"])
def test_a_batch_1_steps_cache_takes_the_factor_and_a_batch_8_ones_does_not(kv) -> None:
    smol = get_preset("smollm2-135m")
    kw = dict(context=2056, weights="int4-g64", kv=kv, table_weights=None, table_kv=None)
    for b, f in ((1, 1.5), (8, 1.0), (4, 1.5 - 0.5 * 2 / 3)):
        flat = plan(smol, profile=_profile(()), batch=b, **kw)
        scaled = plan(smol, profile=_profile(((1.0, 1.5), (8.0, 1.0))), batch=b, **kw)
        assert scaled.t_attention_s == pytest.approx(f * flat.t_attention_s, rel=1e-9)
        assert scaled.t_linear_s == flat.t_linear_s and scaled.overhead_s == flat.overhead_s
        assert scaled.time_s - flat.time_s == pytest.approx((f - 1) * flat.t_attention_s, rel=1e-9)


def test_the_factor_round_trips_and_bad_ones_are_refused() -> None:
    p = _profile(((1.0, 1.46), (8.0, 1.0)))
    d = p.to_dict()
    assert d["kv_batch_factor"] == [[1.0, 1.46], [8.0, 1.0]]
    assert Profile.from_dict(d).kv_batch_factor == ((1.0, 1.46), (8.0, 1.0))
    assert Profile.from_dict({**d, "kv_batch_factor": []}).kv_batch_factor == ()
    for bad in ([[8, 1.0], [1, 1.5]], [[1, 0.0], [8, 1.0]], [[0.5, 1.2], [8, 1.0]], [[1, float("nan")]]):
        with pytest.raises(ProfileError, match="kv_batch_factor"):
            Profile.from_dict({**d, "kv_batch_factor": bad})
    with pytest.raises(ProfileError, match=r"kv_batch_factor must be a list of \[batch, factor\] pairs"):
        Profile.from_dict({**d, "kv_batch_factor": [[1, 2, 3]]})
