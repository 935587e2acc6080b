"""The 16-bit parts every weight format keeps (the LM head) stream at their own measured efficiency, and a head
measured compute-limited has a roofline of its own; a profile without them keeps the 16-bit linears' efficiency and
the one roofline, so its predictions do not change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT
from fewbits.cost.devices import get_device
from fewbits.cost.profile import Profile, ProfileError
from fewbits.cost.step import decode, kv_terms, weight_terms
from fewbits.models.presets import get_preset

SMOL = get_preset("smollm2-135m")


def _linear_time(prof: Profile, weights: str, batch: int = 1) -> tuple:
    dev = get_device("h100")
    w, kv = weight_terms(SMOL, weights, dev, prof), kv_terms(SMOL, "bf16", prof)
    return float(decode(SMOL, dev, prof, w, kv, batch, 128)["t_linear"]), w, dev


def test_profile_without_head_efficiency_predicts_as_before() -> None:
    assert DEFAULT.head_bandwidth_efficiency == 0 and DEFAULT.head_eff() == DEFAULT.bw_eff("float")
    old = Profile.from_dict({k: v for k, v in DEFAULT.to_dict().items() if k != "head_bandwidth_efficiency"})
    assert old.head_eff() == DEFAULT.bw_eff("float")
    assert _linear_time(old, "int4-g64")[0] == _linear_time(DEFAULT, "int4-g64")[0]
    assert DEFAULT.head_compute_efficiency == 0 and _linear_time(DEFAULT, "int4-g64")[1].head_flops == 0


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


def test_a_head_with_its_own_compute_efficiency_is_a_roofline_of_its_own() -> None:
    """The 16-bit head (49152 x 576) at its own compute efficiency: the int4 linears' roofline plus the 16-bit
    parts' max(bytes at their bandwidth efficiency, head FLOPs at the head's compute efficiency).  At batch 1
    both sides are memory-bound and the time is the one roofline's; at a batch where the head's FLOPs outweigh
    its bytes, the head adds its compute time."""
    eta_ch = 0.02  # an H100: the head memory-bound at batch 1 (19 us of bytes, 3 of FLOPs), compute-bound at 64
    prof = replace(DEFAULT, head_bandwidth_efficiency=0.9, head_compute_efficiency=eta_ch)
    base = replace(DEFAULT, head_bandwidth_efficiency=0.9)
    t1, w, dev = _linear_time(prof, "int4-g64", 1)
    assert w.head_flops == 2.0 * 49152 * 576 and w.eta_ch == eta_ch
    assert t1 == pytest.approx(_linear_time(base, "int4-g64", 1)[0], rel=1e-12)
    b = 64
    t64 = _linear_time(prof, "int4-g64", b)[0]
    beta = prof.bandwidth_at(dev, w.dense_q + w.dense_f + b * w.emb_row + w.head_q)
    t_q = max(w.dense_q / w.eta_w / beta, b * (w.linear_flops - w.head_flops) / (w.peak * w.eta_c))
    t_f = max((w.dense_f + b * w.emb_row) / w.eta_f / beta, b * w.head_flops / (dev.peak_flops["bf16"] * eta_ch))
    assert t_f > (w.dense_f + b * w.emb_row) / w.eta_f / beta  # the head is compute-limited here
    assert t64 == pytest.approx(t_q + t_f, rel=1e-9)


def test_a_quantised_head_has_no_16_bit_head_roofline() -> None:
    prof = replace(DEFAULT, head_compute_efficiency=0.1)
    dev = get_device("h100")
    w = weight_terms(SMOL, "int4-g64", dev, prof, lm_head="int8")
    assert w.head_flops == 0 and w.head_q > 0


def test_head_compute_efficiency_round_trips_and_is_validated() -> None:
    prof = replace(DEFAULT, head_compute_efficiency=0.2)
    assert Profile.from_dict(prof.to_dict()).head_compute_efficiency == 0.2
    with pytest.raises(ProfileError, match="head_compute_efficiency"):
        replace(DEFAULT, head_compute_efficiency=1.5)
