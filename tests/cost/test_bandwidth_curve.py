"""The measured bandwidth over working sets of several sizes: interpolated by hand-checked figures, validated,
round-tripped, and read by the step model: the weights at their own working set's rate, the cache at the whole
step's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fewbits.cost import DEFAULT, plan
from fewbits.cost.devices import get_device
from fewbits.cost.profile import Profile, ProfileError, curve_bandwidth
from fewbits.models.presets import get_preset

MiB = float(1 << 20)
CURVE = ((64 * MiB, 40e9), (256 * MiB, 20e9))


def test_curve_interpolates_in_log_bytes_and_never_drops_below_memory() -> None:
    got = curve_bandwidth(CURVE, 25e9, np.array([32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 1024 * MiB]))
    # below the first point: its value; 128 MiB is halfway in log bytes: 30; 256 MiB: 20 < 25, memory's rate;
    # beyond the last point: memory's rate
    assert got == pytest.approx([40e9, 40e9, 30e9, 25e9, 25e9], rel=1e-12)
    assert curve_bandwidth((), 25e9, 1.0) == 25e9 and isinstance(curve_bandwidth(CURVE, 25e9, 128 * MiB), float)


@pytest.mark.parametrize("bad", [((2.0, 1e9), (1.0, 2e9)), ((1.0, -1e9),), ((1.0, float("nan")),), ((1.0,),)])
def test_a_malformed_curve_is_refused(bad) -> None:
    with pytest.raises(ProfileError, match="bandwidth_curve"):
        replace(DEFAULT, bandwidth_curve=bad)


def test_curve_round_trips_through_json() -> None:
    prof = replace(DEFAULT, name="c", bandwidth_curve=CURVE)
    back = Profile.from_dict(prof.to_dict())
    assert back.bandwidth_curve == CURVE
    with pytest.raises(ProfileError, match="bandwidth_curve"):
        Profile.from_dict({**prof.to_dict(), "bandwidth_curve": [[1, "x"]]})


def test_weights_and_cache_stream_at_the_rate_of_the_steps_working_set() -> None:
    """SmolLM2 int4 at batch 1 reads ~110 MB a step: with a curve that reads any working set up to 1 TB at twice
    the device's bandwidth, its linears and its cache take half the time; beyond 1 TB, memory's rate."""
    smol = get_preset("smollm2-135m")
    dev = get_device("h100-sxm")
    fast = replace(DEFAULT, name="fast", bandwidth_curve=((1e12, 2 * dev.bandwidth),))
    kw = dict(device=dev, batch=1, context=2048, weights="int4-g64", table_weights=None, table_kv=None)
    a, b = plan(smol, profile=DEFAULT, **kw), plan(smol, profile=fast, **kw)
    assert a.bound == "memory" and b.t_linear_s == pytest.approx(a.t_linear_s / 2, rel=1e-9)
    assert b.t_attention_s == pytest.approx(a.t_attention_s / 2, rel=1e-9) and a.t_attention_s > 0
    small = replace(DEFAULT, name="small", bandwidth_curve=((1e6, 2 * dev.bandwidth),))  # ~110 MB: beyond it
    assert plan(smol, profile=small, **kw).t_linear_s == pytest.approx(a.t_linear_s, rel=1e-12)
    # the report says the rates it read at, where they are the last-level cache's
    from fewbits.cost.plan import format_breakdown

    assert b.bandwidth == pytest.approx(2 * dev.bandwidth) and a.bandwidth == b.memory_bandwidth == dev.bandwidth
    assert b.weights_bandwidth == pytest.approx(2 * dev.bandwidth) and a.weights_bandwidth == dev.bandwidth
    assert "weights read at 6700.0 GB/s, the cache at 6700.0" in format_breakdown(b)
    assert "read at" not in format_breakdown(a)


def test_the_weights_read_at_their_own_working_sets_rate_the_cache_at_the_whole_steps() -> None:
    """SmolLM2 int4-g64 (~113 MB of weights with its 16-bit head) with a curve that reads up to 200 MB at twice
    memory's rate: at 128 tokens (a few MB of cache) weights and cache both fit; at 2048 tokens, batch 8 (~380
    MB of cache) the cache comes from memory and the weights still at their own working set's rate (measured:
    the bench's steps grew by the cache's time alone)."""
    smol = get_preset("smollm2-135m")
    dev = get_device("h100-sxm")
    prof = replace(DEFAULT, name="l3", bandwidth_curve=((200e6, 2 * dev.bandwidth),))
    kw = dict(device=dev, weights="int4-g64", table_weights=None, table_kv=None, profile=prof)
    short, long = plan(smol, batch=8, context=128, **kw), plan(smol, batch=8, context=2048, **kw)
    assert short.weights_bandwidth == long.weights_bandwidth == pytest.approx(2 * dev.bandwidth)
    assert short.bandwidth == pytest.approx(2 * dev.bandwidth) and long.bandwidth == dev.bandwidth
    assert long.t_linear_s == pytest.approx(short.t_linear_s, rel=1e-12)
    memory = plan(smol, batch=8, context=2048, **{**kw, "profile": DEFAULT})
    assert long.t_attention_s == pytest.approx(memory.t_attention_s, rel=1e-12)
    assert long.t_linear_s == pytest.approx(memory.t_linear_s / 2, rel=1e-9)
