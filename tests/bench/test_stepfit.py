"""The probe's step fit (`fewbits.bench.stepfit`): bounded least squares, so that noisy steps give no negative costs."""

from __future__ import annotations

import numpy as np
import pytest

from fewbits.bench import stepfit
from fewbits.bench.stepfit import bounded_lstsq, fit_step_costs
from fewbits.models.presets import get_preset

# A probe's skeleton steps on a shared host whose step times varied ~30% (SmolLM2-135M's shape, compiled path,
# 2 and 6 layers; seconds after the skeleton's own linears were taken off): (kv, batch, prompt, depth) -> s
NOISY = {("bf16", 1, 128, 6): 183.7e-6, ("bf16", 1, 512, 2): 181.9e-6, ("bf16", 1, 512, 6): 226.0e-6,
         ("bf16", 8, 128, 6): -389.7e-6, ("bf16", 8, 512, 2): 757.8e-6, ("bf16", 8, 512, 6): 823.5e-6,
         ("int8", 1, 512, 6): 101.9e-6, ("int8", 8, 512, 6): 2737.6e-6}


def test_exact_data_inside_the_bounds_give_the_plain_least_squares_solution():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 2.0, size=(12, 4))
    truth = np.array([3e-3, 2e-4, 1.5, -4e-4])  # the last column signed, its value negative
    got = bounded_lstsq(x, x @ truth, ["a0", "a1", "s16", "x:int8"])
    assert list(got) == ["a0", "a1", "s16", "x:int8"]
    assert np.array(list(got.values())) == pytest.approx(truth, rel=1e-9, abs=1e-15)


def test_a_cost_the_data_would_fit_negative_is_held_at_zero():
    """Data whose plain fit is negative in a cost column: bounded, that column is 0 and the rest is the plain fit
    without it (optimal: the residual's gradient pushes the column below zero)."""
    rng = np.random.default_rng(1)
    x = rng.uniform(0.0, 1.0, size=(20, 3))
    y = x @ np.array([2.0, -0.5, 1.0]) + rng.normal(0, 0.01, 20)
    plain = np.linalg.lstsq(x, y, rcond=None)[0]
    assert plain[1] < 0
    got = bounded_lstsq(x, y, ["a0", "p0", "s16"])
    assert got["p0"] == 0.0
    rest = np.linalg.lstsq(x[:, [0, 2]], y, rcond=None)[0]
    assert [got["a0"], got["s16"]] == pytest.approx(rest.tolist(), rel=1e-9)
    r = y - x[:, [0, 2]] @ rest
    assert x[:, 1] @ r < 0  # KKT: raising p0 from 0 would only add to the squared residual


def test_noisy_skeleton_steps_fit_no_negative_cost(monkeypatch):
    spec = get_preset("smollm2-135m")
    fit = fit_step_costs(spec, ("bf16", "int8"), NOISY, 8, 1 << 19, refill_s=6e-6)
    for s in ("bf16", "int8"):  # skeletons at two depths: every cache's own fixed cost per layer is >= 0 too
        assert fit[s]["per_seq_s"] >= 0 and fit[s]["s_per_byte"] >= 0 and fit[s]["quantized_s"] >= 0
        assert fit[s]["fixed_s"] >= 0
    # the unbounded fit of the same points has a step that costs less for each sequence added
    monkeypatch.setattr(stepfit, "bounded_lstsq", lambda x, y, cols, signed=(): dict(
        zip(cols, np.linalg.lstsq(x, y, rcond=None)[0].tolist(), strict=True)))
    plain = fit_step_costs(spec, ("bf16", "int8"), NOISY, 8, 1 << 19, refill_s=6e-6)
    assert plain["bf16"]["per_seq_s"] < 0


def test_one_depth_keeps_a_cache_fixed_cost_relative_to_the_16_bit_one():
    """Skeletons at the model's own depth only (the eager path): a quantised cache's fixed cost is fitted relative
    to the 16-bit cache's and may lie below it."""
    spec = get_preset("smollm2-135m")
    pts = {("bf16", b, c): 2e-3 + 1e-3 * (b - 1) + 1e-6 * c * b for b in (1, 8) for c in (128, 512)}
    pts.update({("int8", b, 512): 1.5e-3 + 1e-3 * (b - 1) + 0.6e-6 * 512 * b for b in (1, 8)})
    fit = fit_step_costs(spec, ("bf16", "int8"), pts, 8, 0, refill_s=0.0)
    assert fit["bf16"]["fixed_s"] == pytest.approx(2e-3, abs=2e-4)
    assert fit["int8"]["fixed_s"] < fit["bf16"]["fixed_s"]


def test_a_cache_efficiency_is_relative_to_the_bandwidth_of_the_models_step():
    """The efficiency is relative to the bandwidth at the working set of a step of the model (30 layers) at the
    skeleton's largest cache: that cache at the model's depth plus the other bytes the step reads.  A 6-layer
    skeleton's 5 MB KIVI cache is 25 MB at 30 layers, inside a 32 MB last-level cache (74 GB/s) alone, but
    beside 56 MB of weights from memory (35 GB/s): 1 / (145e-12 s/B x 35e9 B/s) = 0.197, so the step model
    charges the skeleton's 145 ms per GB.  Its 27 MB 16-bit cache is 135 MB at 30 layers: from memory either way."""
    spec = get_preset("smollm2-135m")
    curve = [(32e6, 74e9), (48e6, 35e9), (1e9, 35e9)]
    bw_at = lambda n: float(np.interp(n, [c[0] for c in curve], [c[1] for c in curve]))  # noqa: E731
    fit = {"bf16": {"fixed_s": 1e-4, "per_seq_s": 7e-5, "s_per_byte": 41e-12, "points": [(8, 2048, 27e6, 3e-3, 6)]},
           "int4": {"fixed_s": 1e-4, "per_seq_s": 7e-5, "s_per_byte": 145e-12, "window_s_per_byte": 65e-12,
                    "quantized_s": 0.0, "points": [(8, 2048, 5e6, 3.6e-3, 6)]}}
    near = stepfit.step_profile_fields(spec, fit, 35e9, lambda _m: None, bw_at=bw_at, weight_bytes=56e6)
    alone = stepfit.step_profile_fields(spec, fit, 35e9, lambda _m: None, bw_at=bw_at)
    assert near["kv_bandwidth_efficiency"]["int4"] == pytest.approx(1 / (145e-12 * 35e9), rel=1e-9)
    assert alone["kv_bandwidth_efficiency"]["int4"] == pytest.approx(1 / (145e-12 * 74e9), rel=1e-9)
    for fields in (near, alone):  # from memory
        assert fields["kv_bandwidth_efficiency"]["float"] == pytest.approx(1 / (41e-12 * 35e9), rel=1e-9)
    assert near["kv_window_bandwidth_efficiency"]["int4"] == pytest.approx(1 / (65e-12 * 35e9), rel=1e-9)


# A compiled probe's skeleton steps with 2048-token points (SmolLM2's shape, 2 and 6 layers, a busy shared host):
# after the skeleton's own linears were taken off (STEPS), and as timed (TIMED); (kv, batch, prompt, depth) -> s
STEPS = {("bf16", 1, 128, 6): 9.6e-05, ("bf16", 1, 512, 6): 0.0001443, ("bf16", 1, 2048, 2): 0.0001532,
         ("bf16", 1, 2048, 6): 0.0003928, ("bf16", 8, 128, 6): 3.23e-05, ("bf16", 8, 512, 6): 0.0005951,
         ("bf16", 8, 2048, 2): 0.0009711, ("bf16", 8, 2048, 6): 0.0027274, ("int8", 1, 2048, 6): 0.000288,
         ("int8", 8, 2048, 6): 0.0021254}
TIMED = {("bf16", 1, 128, 6): 0.0002818, ("bf16", 1, 512, 6): 0.0003301, ("bf16", 1, 2048, 2): 0.0002865,
         ("bf16", 1, 2048, 6): 0.0005786, ("bf16", 8, 128, 6): 0.0008794, ("bf16", 8, 512, 6): 0.0014422,
         ("bf16", 8, 2048, 2): 0.001359, ("bf16", 8, 2048, 6): 0.0035745, ("int8", 1, 2048, 6): 0.0004738,
         ("int8", 8, 2048, 6): 0.0029725}


def test_points_weighted_by_their_timed_steps_keep_the_fixed_cost_of_the_short_ones():
    """Unweighted, the 3.6 ms batch-8 step decides the fit and the 16-bit cache's fixed cost comes out at 0.01 ms
    (the batch-1 steps it must explain take 0.1-0.4 ms); each point weighed by 1 / its timed step (a shared host's
    noise is a share of the time), 0.14 ms, the per-byte cost (batch 8's: batch 1's is 1.09-1.21x it here) within
    8% of the unweighted one.  The weights are relative: all timed steps twice as long give the same fit."""
    spec = get_preset("smollm2-135m")
    plain = fit_step_costs(spec, ("bf16", "int8"), STEPS, 8, 0, refill_s=0.0)
    weighted = fit_step_costs(spec, ("bf16", "int8"), STEPS, 8, 0, refill_s=0.0, measured=TIMED)
    assert plain["bf16"]["fixed_s"] < 0.02e-3
    assert weighted["bf16"]["fixed_s"] > 0.1e-3
    assert weighted["bf16"]["s_per_byte"] == pytest.approx(plain["bf16"]["s_per_byte"], rel=0.08)
    assert 1.0 < weighted["bf16"]["batch_factor"][0][1] < plain["bf16"]["batch_factor"][0][1] < 1.3
    doubled = fit_step_costs(spec, ("bf16", "int8"), STEPS, 8, 0, refill_s=0.0,
                             measured={k: 2 * t for k, t in TIMED.items()})
    for s in ("bf16", "int8"):
        for key in ("fixed_s", "per_seq_s", "s_per_byte"):
            assert doubled[s][key] == pytest.approx(weighted[s][key], rel=1e-6, abs=1e-12)
