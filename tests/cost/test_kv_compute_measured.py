"""A profile whose KV efficiencies were timed on decode steps of the attention itself (`fewbits probe`):
a decode step's attention is its cache bytes at those rates, not the larger of that and a FLOP roofline
whose rate is the linears'.  Checked by hand-computed times on a device whose 16-bit peak makes the roofline
bind, and against the figures of a real probe (SmolLM2 at batch 8 and 2048 tokens, 2 threads)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT, plan
from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import Profile
from fewbits.models.presets import get_preset

#: 2-core CPU figures of a `fewbits probe` run (session of 2026-12-04): memory 35.4 GB/s, bf16 maths widened
#: to fp32 (405 GFLOP/s peak, the linears' compute efficiency 0.182: ~74 GFLOP/s)
CPU = DeviceSpec(key="cpu2", name="2-core CPU", memory_bytes=24e9, bandwidth=35.4e9,
                 peak_flops={"bf16": 404.7e9, "fp32": 100.5e9})


def _profile(measured: bool) -> Profile:
    return replace(DEFAULT, name="cpu2", compute_efficiency={**DEFAULT.compute_efficiency, "float": 0.182},
                   kv_bandwidth_efficiency={**DEFAULT.kv_bandwidth_efficiency, "float": 0.769, "int8": 0.517},
                   overhead_s=0.0, kv_compute_measured=measured, device=CPU)


@pytest.mark.parametrize("kv,eta", [("bf16", 0.769), ("int8-r0", 0.517)])
def test_timed_rates_set_the_attention_and_the_roofline_no_longer_overrides_them(kv, eta) -> None:
    smol = get_preset("smollm2-135m")
    kw = dict(batch=8, context=2056, weights="int4-g64", kv=kv, table_weights=None, table_kv=None)
    guessed, timed = plan(smol, profile=_profile(False), **kw), plan(smol, profile=_profile(True), **kw)
    by_bytes = timed.kv_bytes / (CPU.bandwidth * eta)
    flops = smol.attention_flops_per_pair * 8 * (2056 + 1)
    by_flops = flops / (404.7e9 * 0.182)
    # at batch 8 and 2048 tokens the roofline (~15.4 ms) is above both caches' byte times: it set both steps'
    # attention alike, so an int8 cache could not be faster than a 16-bit one there
    assert by_flops > by_bytes and guessed.t_attention_s == pytest.approx(by_flops, rel=1e-9)
    assert timed.t_attention_s == pytest.approx(by_bytes, rel=1e-9)
    assert timed.t_linear_s == guessed.t_linear_s
    # the prefill's p^2 attention keeps its roofline: its FLOPs per byte grow with the prompt
    assert timed.ttft_s == guessed.ttft_s


def test_the_int8_cache_is_faster_than_the_16bit_one_where_the_probe_timed_it_so() -> None:
    """The probe's skeleton timed the int8 cache at 54.6 ms per GB and the 16-bit at 36.7 (eta 0.517 and 0.769
    at 35.4 GB/s): half the bytes at 1.49x the time per byte.  SmolLM2 then measured 21.2 against 24.3 ms a
    step (`fewbits bench`, batch 8, 2048 tokens, int4-g64 weights); with the roofline both were ~27.1-27.3 ms."""
    smol = get_preset("smollm2-135m")
    kw = dict(batch=8, context=2056, weights="int4-g64", table_weights=None, table_kv=None)
    for measured in (False, True):
        b16 = plan(smol, profile=_profile(measured), kv="bf16", **kw)
        i8 = plan(smol, profile=_profile(measured), kv="int8-r0", **kw)
        gain = b16.t_attention_s / i8.t_attention_s
        if measured:
            assert gain == pytest.approx(b16.kv_bytes / 0.769 / (i8.kv_bytes / 0.517), rel=1e-9)
            assert 1.3 < gain < 1.4
        else:
            assert gain == pytest.approx(1.0, rel=1e-9)


def test_the_flag_round_trips_and_old_profiles_keep_the_roofline() -> None:
    prof = _profile(True)
    assert Profile.from_dict(prof.to_dict()).kv_compute_measured is True
    old = {k: v for k, v in prof.to_dict().items() if k != "kv_compute_measured"}
    assert Profile.from_dict(old).kv_compute_measured is False
