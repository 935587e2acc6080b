"""The probe on a tiny model and small buffers: a valid profile that the cost model loads and uses."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fewbits.bench.decode import BenchRow, format_row, summary
from fewbits.bench.gemv import build_set, effective_spec
from fewbits.bench.probe import build_profile, layer_shapes, sixteen_bit_peaks
from fewbits.bench.stepfit import step_profile_fields
from fewbits.cost.plan import plan
from fewbits.cost.profile import DEFAULT, load_profile, save_profile
from fewbits.kernels import choose_kernel
from fewbits.models.spec import ModelSpec

TINY = ModelSpec(name="tiny", family="llama", n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256, tie_embeddings=True, max_position_embeddings=4096)


def test_effective_spec_regroups_only_misfits():
    assert effective_spec("int4-g128", 576) == "int4-g64"
    assert effective_spec("int4-g128", 1536) == "int4-g128"
    assert effective_spec("int8", 576) == "int8"


def test_weight_set_bytes_and_copies():
    ws = build_set("int4-g64", ((64, 128), (32, 64)), min_bytes=10_000)
    assert ws.nbytes == 64 * 64 + 64 * 2 * 2 + 32 * 32 + 32 * 1 * 2  # codes + fp16 group scales
    assert ws.copies == -(-10_000 // ws.nbytes) and len(ws.kernels) == 2 * ws.copies
    assert ws.kernel_names == (choose_kernel("int4-g64", (64, 128))[0].name,)


def _canned(monkeypatch):
    """Replace the timed measurements with hand-set figures so that the assembly is checked exactly."""
    from fewbits.bench import probe

    bw = 10e9
    seen = _canned.devices = {}  # measurement -> the device it was asked to run on
    _canned.graphs = []  # what each sweep of the GEMV passes was given to keep its compiled graphs in

    def saw(what, device, value):
        seen[what] = str(device)
        return value

    monkeypatch.setattr(probe, "memory_bandwidth", lambda nbytes=0, device="cpu": saw("bandwidth", device, bw))
    # a working set of 32 MiB is read twice as fast as memory (the last-level cache)
    monkeypatch.setattr(probe, "bandwidth_curve", lambda sizes=(), device="cpu", memory=None: saw(
        "curve", device, ((float(32 << 20), 2 * bw), (float(memory[0]), memory[1]))))
    monkeypatch.setattr(probe, "matmul_rates", lambda n=0, device="cpu": saw(
        "matmul", device, {"fp32": 1e11, "bf16": 5e11, "int8": 1e12}))

    def passes(spec, formats, min_bytes, device="cpu", fused=False, graphs=None):
        saw("gemv", device, None)
        _canned.graphs.append(graphs)
        out = {}
        # int4-g64+a8: its own kernel (int8 activations), faster; int8+a8: the same kernel as int8 (none here)
        for f, (nbytes, t1, t8, tc) in {"bf16": (8e6, 2e-3, 2e-3, 1e-4), "int8": (4e6, 1e-3, 4e-3, 2.4e-4),
                                        "int4-g64": (2e6, 0.8e-3, 0.85e-3, 1e-4),
                                        "int4-g64+a8": (2e6, 0.5e-3, 0.55e-3, 1e-4),
                                        "int8+a8": (4e6, 1e-3, 4e-3, 2.4e-4)}.items():
            if f in formats:
                c8 = tc + (1.4e-4 if f == "int8" else 0.0)
                # the compiled CPU step's passes count whole, their calls included (`gemv_passes`)
                out[f] = {"kernels": ["k_a8" if f == "int4-g64+a8" else "k"], "bytes": nbytes, "whole_pass": fused,
                          **({"pool_bytes": 32 << 20} if f.startswith("int4-g64") else {}),
                          "rows1": {"t_s": t1 + tc, "t_calls_s": tc, "t_bytes_s": t1 + tc if fused else t1,
                                    "flops": 1e6},
                          "rows8": {"t_s": t8 + c8, "t_calls_s": c8, "t_bytes_s": t8 + c8 if fused else t8,
                                    "flops": 8e6}}
        out["lm_head_bf16"] = {"bytes": 1e6, "rows1": {"t_s": 1e-3}, "rows8": {"t_s": 2e-3}}
        return out

    monkeypatch.setattr(probe, "gemv_passes", passes)
    # the skeleton step spends 0.15 ms in its own 16-bit linears
    monkeypatch.setattr(probe, "skeleton_linear_cost", lambda spec, device="cpu": saw("skeleton", device, 1.5e-4))
    # the work between the matmuls at the model's widths: 2e-12 s per layer and width element at batch 1, 9e-12 at 8
    monkeypatch.setattr(probe, "width_cost", lambda spec, device="cpu": saw("width", device,
                                                                          {1: 2e-12, 8: 9e-12}))
    # fitted skeleton steps: 20 ms fixed, 1 ms per extra sequence; the int8 cache adds 0.5 ms per layer
    monkeypatch.setattr(probe, "step_costs", lambda spec, kvs, ctx, device="cpu", compiled=True, **_: saw(
        "steps", device, {
        s: {"fixed_s": a, "per_seq_s": 1e-3, "s_per_byte": 1 / (e * bw), "points": [], "refill_s": 2e-5,
            "refill_bytes": 1 << 21}
        for s, a, e in (("bf16", 0.02, 0.5), ("int8", 0.021, 0.05)) if s in kvs}))
    return bw


@pytest.mark.parametrize("evicted", [True, False])
def test_an_evicted_cache_is_rated_against_memory(monkeypatch, evicted):
    """Where the probe evicted its skeleton's cache before each step, the cache came from memory: its efficiency
    is relative to memory's bandwidth; else to the curve's at the model's working set (here 4 MB: the last-level
    cache's 2 bw)."""
    from fewbits.bench import probe

    bw = _canned(monkeypatch)
    monkeypatch.setattr(probe, "step_costs", lambda spec, kvs, ctx, device="cpu", compiled=True, **_: {
        "bf16": {"fixed_s": 1e-3, "per_seq_s": 1e-4, "s_per_byte": 1 / (0.5 * bw), "points": [(8, 96, 1e6, 1e-3, 2)],
                 "refill_s": 0.0, "refill_bytes": 0, "cache_evicted": evicted}})
    prof = build_profile(TINY, weight_specs=("int8",), kv_specs=("bf16",), log=lambda _: None)
    assert prof.kv_eff("float") == pytest.approx(0.5 if evicted else 0.25)


def test_probe_assembles_profile_and_plan_uses_it(tmp_path, monkeypatch):
    bw = _canned(monkeypatch)
    prof = build_profile(TINY, weight_specs=("int8", "int4-g64"), kv_specs=("bf16", "int8"), log=lambda _: None,
                         compiled=False)
    compiled = build_profile(TINY, weight_specs=("int8", "int4-g64"), kv_specs=("bf16", "int8"), log=lambda _: None)
    # compiled (the default): a quantised matmul is one operator call, as the skeleton's 16-bit one it replaces
    assert compiled.measured["decode_path"] == "compiled" and prof.measured["decode_path"] == "eager"
    # the KV rates are the attention's own timed steps, its maths included: no FLOP roofline over them
    assert compiled.kv_compute_measured and prof.kv_compute_measured and not DEFAULT.kv_compute_measured
    assert compiled.call_overhead("int8") == 0.0 and prof.call_overhead("int8") > 0
    # and its passes count whole, their calls' time with their bytes' (eager: charged per call instead)
    assert compiled.bw_eff("int8") == pytest.approx(4e6 / (1e-3 + 2.4e-4) / bw)
    # the 16-bit linears and the 16-bit LM head each at their own rate (not one blend of both)
    assert prof.bw_eff("float") == pytest.approx(8e6 / 2e-3 / bw)
    assert prof.head_eff() == pytest.approx(1e6 / 1e-3 / bw)
    assert prof.bw_eff("int8") == pytest.approx(4e6 / 1e-3 / bw)
    # int4's pass cycled a pool of 32 MiB (its footprint), read at the curve's 2 bw: relative to that
    assert prof.bw_eff("int4") == pytest.approx(2e6 / 0.8e-3 / (2 * bw))
    # the CPU probe also times the integer formats' int8-activation kernels where they differ: int4's ("+a8" family)
    assert prof.bw_eff("int4+a8") == pytest.approx(2e6 / 0.5e-3 / (2 * bw))
    assert "int8+a8" not in prof.bandwidth_efficiency and prof.bw_eff("int8+a8") == prof.bw_eff("int8")
    assert prof.bandwidth_curve == ((32 << 20, 2 * bw), (1 << 30, bw))
    # the head takes 2x longer at 8 rows: compute-limited, a compute efficiency of its own, 2*8*256*64 FLOPs / (2 ms
    # * 5e11) = 2.6e-4, held at the floor every efficiency has (1e-3); int8 takes 4x longer at 8 rows: compute-limited
    # too, its linears' own 8e6 FLOPs / (4 ms * 5e11)
    assert 2 * 8 * 256 * 64 / (2e-3 * 5e11) < 1e-3 and prof.head_compute_efficiency == 1e-3
    assert prof.compute_eff("int8") == pytest.approx(8e6 / (4e-3 * 5e11))
    assert "int4" not in prof.compute_efficiency  # 0.85 ms vs 0.8 ms: still memory-bound
    assert prof.kv_eff("int8") == pytest.approx(0.05) and prof.overhead_s == 0.02
    assert prof.overhead_per_seq_s == 1e-3
    assert prof.kv_overhead("int8") == pytest.approx(0.001 / TINY.n_layers)
    # 7 linears x 2 layers: int8 kernel calls take 0.24 ms, the 16-bit tiny calls beside them 0.1 ms (on a CPU the
    # skeleton's own 16-bit calls, timed inside its steps, are not the base: its steps already pay them); int4's
    # calls 0.1 ms, no extra
    assert prof.call_overhead("int8") == pytest.approx(1.4e-4 / 14)
    assert prof.call_overhead("int4") == pytest.approx(0.0)
    assert prof.measured["skeleton_linears_s"] is None
    assert prof.device is not None and prof.device.peak_flops["int8"] == 1e12 and prof.low_precision_compute
    # every measurement ran on the device asked for (the CPU by default), and the profile says which
    assert _canned.devices == dict.fromkeys(("bandwidth", "curve", "matmul", "gemv", "steps", "width"), "cpu")
    # the compiled path's profile has the work between the matmuls at the model's widths, one rate per row of the
    # batch ((2e-12 + 8 x 9e-12) / 65); the eager one does not measure it (its skeleton's steps are the model's own)
    rate = 74e-12 / 65
    assert (compiled.width_overhead_s, compiled.width_overhead_per_seq_s) == pytest.approx((rate, rate))
    assert compiled.measured["width_cost_s"] == {"1": 2e-12, "8": 9e-12}
    assert (prof.width_overhead_s, prof.width_overhead_per_seq_s) == (0.0, 0.0)
    kw = dict(context=128, weights="int8", kv="bf16", table_weights=None, table_kv=None)
    without = dataclasses.replace(compiled, width_overhead_s=0.0, width_overhead_per_seq_s=0.0)
    for b in (1, 8):
        added = plan(TINY, batch=b, profile=compiled, **kw).overhead_s \
            - plan(TINY, batch=b, profile=without, **kw).overhead_s
        assert added == pytest.approx(2 * (64 + 128) * rate * b)
    assert prof.measured["device"] == "cpu"
    layer = ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    assert layer_shapes(TINY) == layer
    path = tmp_path / "p.json"
    save_profile(prof, path)
    loaded = load_profile(str(path))
    assert all(loaded.bw_eff(f) == prof.bw_eff(f) for f in prof.bandwidth_efficiency)
    assert loaded.head_bandwidth_efficiency == prof.head_eff() == pytest.approx(0.1)
    assert loaded.device == prof.device and loaded.bandwidth_curve == prof.bandwidth_curve
    r = plan(TINY, batch=1, context=128, weights="int8", kv="int8-g16", profile=loaded,
             table_weights=None, table_kv=None)
    assert r.device == prof.device.name and math.isfinite(r.time_s)
    assert r.time_s > prof.overhead_s  # overhead plus a positive memory time
    assert loaded.cache_refill_s == 2e-5 and loaded.cache_refill_bytes == 1 << 21
    # the overhead the step adds: fixed + the int8 weights' extra per call (0.14 ms over 14 calls) + the int8
    # cache's per layer + the refill after each layer's stream (its int8 weights and 129 tokens of 16-bit keys and
    # values)
    layer_bytes = (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3) + 128 * 2 * 4 + 129 * 2 * 2 * 16 * 2
    refill = 2 * 2e-5 * layer_bytes / (1 << 21)
    assert r.overhead_s == pytest.approx(0.02 + 1.4e-4 + 2 * 5e-4 + refill)
    r8 = plan(TINY, batch=8, context=128, weights="int8", kv="int8-g16", profile=loaded,
              table_weights=None, table_kv=None)
    # batch 8: the fit's 1 ms per extra sequence, the refill of 7 more sequences' keys and values, and the int8
    # calls' own work per extra row: their tiny calls grew 0.14 ms from 1 to 8 rows, over 14 calls x 7 rows
    assert loaded.call_per_seq("int8") == pytest.approx(1.4e-4 / (14 * 7)) and loaded.call_per_seq("float") == 0
    assert compiled.call_per_seq("int8") == 0.0  # its whole passes hold their calls' growth
    assert r8.overhead_s == pytest.approx(r.overhead_s + 7e-3 + 2 * 2e-5 * 7 * 129 * 2 * 2 * 16 * 2 / (1 << 21)
                                          + 1.4e-4)


def test_bench_row_formatting():
    row = BenchRow("int8", "bf16", 1, 128, 8, 50.0, 55.0, 20.0, 45.0, -10.0, 1.5, "cpu_int8pack", 1000, "memory")
    assert "-10.0%" in format_row(row) and "cpu_int8pack" in format_row(row)
    assert summary([row]).startswith("1/1 rows within 15%")
    assert summary([]) == "no rows"


@pytest.mark.parametrize("bad", ["0", "x", ""])
def test_bench_cli_rejects_bad_lists(bad):
    from click.testing import CliRunner

    from fewbits.cli import main

    out = CliRunner().invoke(main, ["bench", "smollm2-135m", "--batch", bad, "--profile", "nowhere.json"])
    assert out.exit_code != 0


def _no_skeleton_rows(monkeypatch):
    """Fake steps have no linears of their own for `step_costs` to take off."""
    from fewbits.bench import probe

    monkeypatch.setattr(probe, "skeleton_rows_cost", lambda model, batches, compiled=True: {
        b: {"head": 0.0, "layer": 0.0} for b in batches})


def _fake_steps(monkeypatch, fixed, per_seq, s16, s_q, refill=0.0, refill_bytes=1, curve=None):
    """Replace `generate` with a step time built from the model the probe fits (true cache bytes)."""
    import fewbits.generate
    from fewbits.cost.step import attention_layer_bytes, kv_step_bytes, kv_terms
    from fewbits.generate import GenerationResult
    from fewbits.kvcache.format import parse_kv_format

    def fake_generate(model, ids, n, kv="bf16", between=None):
        b, c = ids.shape
        for _ in range(n - 1):  # before every timed step, as `decode_loop`
            if between is not None:
                between()
        kvf = parse_kv_format(kv)
        ctx = c + n // 2
        kb = kv_step_bytes(kv_terms(TINY, kvf.full_spec, DEFAULT), b, ctx)
        q, w = float(kb["read_q"] + kb["write_q"]), float(kb["read_w"] + kb["write_w"])
        if not kvf.is_quantized:
            q, w = 0.0, q + w
        x = float(attention_layer_bytes(TINY, b * (ctx + 1)))
        t = (fixed[kvf.spec] + per_seq * (b - 1) + s16 * w + s_q.get(kvf.spec, 0.0) * q
             + refill * TINY.n_layers * min(1.0, x / refill_bytes))
        if curve:  # a measured refill curve E(x) per layer, interpolated from 0 at 0 bytes
            t += TINY.n_layers * float(np.interp(x, [0.0] + [p[0] for p in curve], [0.0] + [p[1] for p in curve]))
        return GenerationResult(ids[:, :1], c, 0.0, [t + 1e-3, t, t + 2e-3])

    monkeypatch.setattr(fewbits.generate, "generate", fake_generate)
    _no_skeleton_rows(monkeypatch)


def test_step_costs_fit_recovers_fixed_per_sequence_and_per_byte_costs(monkeypatch):
    from fewbits.bench.probe import step_costs

    # 5 ms (+1 ms with the int4 cache) + 2 ms per extra sequence + 1 ns per 16-bit byte, 4 ns per int4 byte
    # (a KIVI cache with a 16-token window, so that both contexts hold quantised tokens and a window)
    kivi = "int4-g16-r16"
    _fake_steps(monkeypatch, {"bf16": 5e-3, kivi: 6e-3}, 2e-3, 1e-9, {kivi: 4e-9})
    res = step_costs(TINY, ("bf16", kivi), contexts=(32, 96), steps=8, refill_bytes=0, measure_refill=False)
    assert res["bf16"]["fixed_s"] == pytest.approx(5e-3, rel=1e-6)
    assert res[kivi]["fixed_s"] == pytest.approx(6e-3, rel=1e-6)
    assert res["bf16"]["s_per_byte"] == pytest.approx(1e-9, rel=1e-6)
    assert res[kivi]["s_per_byte"] == pytest.approx(4e-9, rel=1e-6)
    for r in res.values():
        assert r["per_seq_s"] == pytest.approx(2e-3, rel=1e-6)
        assert r["window_s_per_byte"] == pytest.approx(1e-9, rel=1e-6)
        assert r["refill_s"] == 0 and len(r["points"]) == 4


def test_step_costs_take_off_the_skeletons_own_linears_per_row(monkeypatch):
    """Steps that also pay the skeleton's head (0.8 ms) and each layer's linears (30 us) more at batch 8 than at 1:
    taken off before the fit, the per-sequence cost is the 2 ms the rest of the step costs, not 2 ms + 1.1 ms / 7."""
    import fewbits.generate
    from fewbits.bench import probe
    from fewbits.bench.probe import step_costs

    _fake_steps(monkeypatch, {"bf16": 5e-3}, 2e-3, 1e-9, {})
    inner = fewbits.generate.generate
    rows = {1: {"head": 0.0, "layer": 0.0}, 8: {"head": 8e-4, "layer": 3e-5}}

    def with_linears(model, ids, n, kv="bf16", between=None):
        r = inner(model, ids, n, kv, between)
        extra = rows[ids.shape[0]]["head"] + model.config.num_hidden_layers * rows[ids.shape[0]]["layer"]
        return dataclasses.replace(r, decode_step_s=[t + extra for t in r.decode_step_s])

    monkeypatch.setattr(fewbits.generate, "generate", with_linears)
    monkeypatch.setattr(probe, "skeleton_rows_cost", lambda model, batches, compiled=True: rows)
    res = step_costs(TINY, ("bf16",), contexts=(32, 96), steps=8, refill_bytes=0, measure_refill=False)
    assert res["bf16"]["per_seq_s"] == pytest.approx(2e-3, rel=1e-6)
    assert res["bf16"]["fixed_s"] == pytest.approx(5e-3, rel=1e-6)


def test_skeleton_rows_cost_measures_its_head_and_a_layer_per_batch():
    from fewbits.bench.probe import skeleton_model
    from fewbits.bench.probe_calls import skeleton_rows_cost, take_off_rows

    model = skeleton_model(TINY)
    for compiled in (True, False):
        rows = skeleton_rows_cost(model, (1, 8), compiled=compiled, rounds=2, calls=2)
        assert set(rows) == {1, 8} and all(set(r) == {"head", "layer"} for r in rows.values())
        assert all(0.0 <= v < 0.1 and math.isfinite(v) for r in rows.values() for v in r.values())
    rows = {1: {"head": 0.0, "layer": 0.0}, 8: {"head": 1e-3, "layer": 1e-4}}
    got = take_off_rows({("bf16", 1, 32, 6): 5e-3, ("bf16", 8, 32, 6): 9e-3, ("bf16", 8, 32, 2): 8e-3}, rows)
    assert got == pytest.approx({("bf16", 1, 32, 6): 5e-3, ("bf16", 8, 32, 6): 7.4e-3, ("bf16", 8, 32, 2): 6.8e-3})


def test_step_costs_fit_recovers_the_cache_refill(monkeypatch):
    """A batch-1 step whose small cache evicts part of the core cache, a batch-8 one all of it."""
    from fewbits.bench.probe import step_costs

    x_cache = 8 * 128 * 40  # between the batch-1 and the batch-8 footprints of one layer
    kivi = "int4-g16-r16"
    _fake_steps(monkeypatch, {"bf16": 5e-3, "int8": 5.5e-3, kivi: 6e-3}, 2e-3, 1e-9, {"int8": 2e-9, kivi: 4e-9},
                refill=1e-4, refill_bytes=x_cache)
    res = step_costs(TINY, ("bf16", "int8", kivi), contexts=(32, 96), steps=8, refill_bytes=x_cache,
                     measure_refill=False)
    assert res["bf16"]["refill_s"] == pytest.approx(1e-4, rel=1e-6) and res["bf16"]["refill_bytes"] == x_cache
    assert res["int8"]["s_per_byte"] == pytest.approx(2e-9, rel=1e-6)
    assert res[kivi]["fixed_s"] == pytest.approx(6e-3, rel=1e-6)
    assert res["bf16"]["per_seq_s"] == pytest.approx(2e-3, rel=1e-6)
    # a measured refill is taken as given: the fit of the rest recovers the same figures
    from fewbits.bench.probe import fit_step_costs

    fastest = {(s, b, c): t for s, r in res.items() for b, c, _, t, *_ in r["points"]}
    again = fit_step_costs(TINY, ("bf16", "int8", kivi), fastest, 8, x_cache, refill_s=1e-4)
    assert again["int8"]["s_per_byte"] == pytest.approx(2e-9, rel=1e-6) and again["bf16"]["refill_s"] == 1e-4
    assert again[kivi]["fixed_s"] == pytest.approx(6e-3, rel=1e-6)


def test_step_costs_fit_recovers_the_kivi_window_rate_and_dequantisation_jump(monkeypatch):
    """A KIVI cache costs more per window byte than the 16-bit cache (copied every step) and a fixed
    dequantisation once its window has overflowed: at prompt 8 it never has, at 96 it has."""
    import fewbits.generate
    from fewbits.bench.probe import step_costs
    from fewbits.cost.profile import DEFAULT
    from fewbits.cost.step import kv_step_bytes, kv_terms
    from fewbits.generate import GenerationResult
    from fewbits.kvcache.format import parse_kv_format

    kivi = "int4-g16-r16"
    _no_skeleton_rows(monkeypatch)

    def fake_generate(model, ids, n, kv="bf16", between=None):
        b, c = ids.shape
        kvf = parse_kv_format(kv)
        kb = kv_step_bytes(kv_terms(TINY, kvf.full_spec, DEFAULT), b, c + n // 2)
        q, w = float(kb["read_q"] + kb["write_q"]), float(kb["read_w"] + kb["write_w"])
        if kvf.is_quantized:
            t = 6e-3 + 2e-3 * (b - 1) + 4e-9 * q + 3e-9 * w + 1.5e-3 * (kvf.quantized_tokens(c + n - 1) > 0)
        else:
            t = 5e-3 + 2e-3 * (b - 1) + 1e-9 * (q + w)
        return GenerationResult(ids[:, :1], c, 0.0, [t])

    monkeypatch.setattr(fewbits.generate, "generate", fake_generate)
    res = step_costs(TINY, ("bf16", kivi), contexts=(8, 96), steps=8, refill_bytes=0, measure_refill=False)
    r = res[kivi]
    assert r["fixed_s"] == pytest.approx(6e-3, rel=1e-6) and r["quantized_s"] == pytest.approx(1.5e-3, rel=1e-6)
    assert r["s_per_byte"] == pytest.approx(4e-9, rel=1e-6) and r["window_s_per_byte"] == pytest.approx(3e-9, rel=1e-6)
    assert res["bf16"]["quantized_s"] == 0 and res["bf16"]["s_per_byte"] == pytest.approx(1e-9, rel=1e-6)


def test_gemv_passes_time_whole_steps_with_the_models_input_shape(monkeypatch):
    """The fastest sample must cover a whole step's linears (the statistic the bench reports: its fastest
    step), not one layer scaled by the depth, and the kernels must see (rows, 1, in) inputs as in the model."""
    from fewbits.bench import probe

    seen_shapes: set[tuple[int, ...]] = set()
    per_sample: list[int] = []
    real_build = probe.build_set

    def spy_build(spec, shapes, min_bytes=0, seed=0, device="cpu"):
        ws = real_build(spec, shapes, 0, seed, device)
        real_sampler = ws.sampler

        def sampler(xs, n, graphs=None):
            assert graphs is None  # the eager path's calls: from Python
            per_sample.append(n)
            seen_shapes.update(tuple(x.shape) for x in xs.values())
            return real_sampler(xs, n)

        ws.sampler = sampler
        return ws

    def fake_interleaved(fns, min_time=0.0, rounds=7, warmup=2, statistic="min", sync=None):
        for fn in fns.values():
            fn()
        return {name: {"body": 3e-3, "tiny": 1e-3, "head": 5e-4}[name] for name in fns}

    monkeypatch.setattr(probe, "build_set", spy_build)
    monkeypatch.setattr(probe, "time_interleaved", fake_interleaved)
    res = probe.gemv_passes(TINY, ("bf16",), 0, rows=(1, 8))
    n_linears = len(layer_shapes(TINY))
    assert n_linears * TINY.n_layers in per_sample and n_linears not in per_sample  # one sample = one step
    assert 1 in per_sample  # and the head, once a sample
    r = res["bf16"]["rows8"]
    assert r["t_calls_s"] == pytest.approx(1e-3) and r["t_bytes_s"] == max(r["t_s"] - 1e-3, 1e-9)
    assert res["bf16"]["whole_pass"] is False  # Python calls (the eager step's): charged per call, not as bytes
    assert res["lm_head_bf16"]["rows1"]["t_s"] == res["bf16"]["rows1"]["t_head_s"] > 0
    assert all(len(s) == 3 and s[1] == 1 and s[0] in (1, 8) for s in seen_shapes)


def test_gemv_passes_cycle_the_models_own_footprint_by_default(monkeypatch):
    """Each format's pool is the step's own working set: one copy of its linears in the format and of the 16-bit
    head, run in one sample as the step runs them; an explicit size still wins."""
    from fewbits.bench import probe

    pools: list[tuple[str, int]] = []
    real_build = probe.build_set

    def spy_build(spec, shapes, min_bytes=0, seed=0, device="cpu"):
        pools.append((spec, min_bytes))
        return real_build(spec, shapes, min(min_bytes, 1 << 16), seed, device)

    monkeypatch.setattr(probe, "build_set", spy_build)
    monkeypatch.setattr(probe, "time_interleaved", lambda fns, **_: {name: (fn(), 1e-3)[1] for name, fn in fns.items()})
    res = probe.gemv_passes(TINY, ("int8",), rows=(1,))
    head = 2 * TINY.vocab_size * TINY.hidden_size
    layer8 = real_build("int8", layer_shapes(TINY)).nbytes
    assert ("int8", layer8 * TINY.n_layers) in pools and ("bf16", 0) in pools  # one copy of each
    assert res["int8"]["pool_bytes"] == layer8 * TINY.n_layers + head == res["lm_head_bf16"]["pool_bytes"]
    pools.clear()
    probe.gemv_passes(TINY, ("int8",), 5 << 20, rows=(1,))
    assert ("int8", 5 << 20) in pools and ("bf16", 5 << 20) in pools


def test_refill_curve_per_layer_sorted_and_non_decreasing():
    from fewbits.bench.probe import refill_curve

    rests = {2.0: {False: 1.0, True: 1.0 + 30 * 1.5e-4},  # a dip below the 1 x point: noise
             0.5: {False: 1.0, True: 1.0 + 30 * 1e-4}, 1.0: {False: 2.0, True: 2.0 + 30 * 2e-4}, 4.0: {False: 1.0}}
    got = refill_curve(1000, rests, 30)
    assert [b for b, _ in got] == [500.0, 1000.0, 2000.0]
    assert [e for _, e in got] == pytest.approx([1e-4, 2e-4, 2e-4], rel=1e-9)


def test_step_costs_fit_subtracts_the_measured_refill_curve(monkeypatch):
    """Steps whose refill follows a curve (steep to the L2 size, flat after): the fit that subtracts the
    curve recovers the fixed and per-byte costs; the ramp E min(1, x / X) through the 2 X point does not."""
    from fewbits.bench.probe import fit_step_costs, step_costs

    x_cache = 8 * 128 * 40
    curve = [(x_cache / 2, 0.3e-4), (x_cache, 0.5e-4), (2 * x_cache, 1e-4), (8 * x_cache, 1.2e-4)]
    _fake_steps(monkeypatch, {"bf16": 5e-3, "int8": 5.5e-3}, 2e-3, 1e-9, {"int8": 2e-9}, curve=curve)
    res = step_costs(TINY, ("bf16", "int8"), contexts=(32, 96), steps=8, refill_bytes=x_cache, measure_refill=False)
    fastest = {(s, b, c): t for s, r in res.items() for b, c, _, t, *_ in r["points"]}
    fit = fit_step_costs(TINY, ("bf16", "int8"), fastest, 8, x_cache, refill_s=1e-4, refill_curve=curve)
    assert fit["bf16"]["fixed_s"] == pytest.approx(5e-3, rel=1e-6)
    assert fit["int8"]["s_per_byte"] == pytest.approx(2e-9, rel=1e-6)
    assert fit["bf16"]["per_seq_s"] == pytest.approx(2e-3, rel=1e-6)
    assert fit["bf16"]["refill_curve"] == [list(p) for p in curve]
    ramp = fit_step_costs(TINY, ("bf16", "int8"), fastest, 8, x_cache, refill_s=1e-4)
    assert abs(ramp["bf16"]["fixed_s"] - 5e-3) > 1e-5 or abs(ramp["bf16"]["per_seq_s"] - 2e-3) > 1e-5


def test_16_bit_model_time_unchanged_and_quantised_head_at_its_own_rate(monkeypatch):
    """Splitting the 16-bit efficiency into linears and LM head reproduces the 16-bit model's measured
    linears + head time exactly, and charges a quantised model's 16-bit head its own measured time."""
    from fewbits.bench.probe_calls import linear_efficiencies

    bw = 10e9
    passes = {"bf16": {"kernels": ["k"], "bytes": 8e6,
                       "rows1": {"t_s": 2.1e-3, "t_calls_s": 1e-4, "t_bytes_s": 2e-3, "flops": 1e6},
                       "rows8": {"t_s": 2.1e-3, "t_calls_s": 1e-4, "t_bytes_s": 2e-3, "flops": 8e6}},
              "lm_head_bf16": {"bytes": 1e6, "rows1": {"t_s": 1e-4}, "rows8": {"t_s": 2e-4}}}
    bw_eff, head, _, _, _ = linear_efficiencies(TINY, passes, bw, 5e11, log=lambda _: None)
    # 16-bit model: body / (eta bw) + head / (eta_head bw) = 2 ms + 0.1 ms, the two measured times
    assert 8e6 / (bw_eff["float"] * bw) + 1e6 / (head * bw) == pytest.approx(2.1e-3, rel=1e-12)
    # the blended rate (9 MB / 2.1 ms) would have charged the head 0.233 ms, not its 0.1 ms
    assert 1e6 / (head * bw) == pytest.approx(1e-4, rel=1e-12)


def test_a_head_compute_limited_at_8_rows_gets_a_compute_efficiency_of_its_own():
    """Where the 16-bit head's 8-row pass takes over 1.15x its 1-row pass, its FLOPs at 8 rows over that time are
    its own compute efficiency and a compute-limited family's is its linears' alone; where it does not, the head
    has none (0) and the family's efficiency counts the head's 8-row FLOPs and time with its own, as before."""
    from fewbits.bench.probe import head_shape
    from fewbits.bench.probe_calls import linear_efficiencies

    peak = 5e11
    head_flops8 = 2 * 8 * head_shape(TINY)[0] * head_shape(TINY)[1]
    row = {"t_s": 2.1e-3, "t_calls_s": 1e-4, "t_bytes_s": 2e-3, "flops": 1e6}
    fam8 = {"t_s": 4.1e-3, "t_calls_s": 1e-4, "t_bytes_s": 4e-3, "flops": 8e6}  # compute-limited at 8 rows
    for h8, own in ((3e-4, True), (1.1e-4, False)):
        passes = {"bf16": {"kernels": ["k"], "bytes": 8e6, "rows1": row, "rows8": fam8},
                  "lm_head_bf16": {"bytes": 1e6, "rows1": {"t_s": 1e-4}, "rows8": {"t_s": h8}}}
        _, _, comp, _, head_comp = linear_efficiencies(TINY, passes, 10e9, peak, log=lambda _: None)
        if own:
            assert head_comp == pytest.approx(head_flops8 / (h8 * peak), rel=1e-12)
            assert comp["float"] == pytest.approx(8e6 / (4e-3 * peak), rel=1e-12)
        else:
            assert head_comp == 0
            assert comp["float"] == pytest.approx((8e6 + head_flops8) / ((4e-3 + h8) * peak), rel=1e-12)


def test_skeleton_linear_cost_measures_the_skeletons_own_linears():
    from fewbits.bench.probe_calls import _ZeroLinear, skeleton_linear_cost

    z = _ZeroLinear(5)
    out = z(torch.ones(2, 1, 3, dtype=torch.bfloat16))
    assert out.shape == (2, 1, 5) and out.dtype == torch.bfloat16 and not out.any()
    assert z(torch.ones(2, 1, 3, dtype=torch.bfloat16)) is out  # no allocation per call
    t = skeleton_linear_cost(TINY, context=8, steps=2, rounds=2)
    # 14 bf16 linear calls of a step take microseconds each, well under a second
    assert math.isfinite(t) and 0 <= t < 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_on_cuda_measures_the_gpu():
    """The whole probe on a CUDA device with small buffers: the GPU's own figures, its kernels, no refill."""
    from fewbits.bench.machine import matmul_rates, memory_bandwidth
    from fewbits.bench.probe import gemv_passes

    assert memory_bandwidth(256 << 20, device="cuda") > 2e11  # any datacenter GPU reads > 200 GB/s
    assert matmul_rates(2048, "cuda")["bf16"] > 1e13  # and multiplies bf16 at > 10 TFLOP/s
    passes = gemv_passes(TINY, ("bf16", "int8", "int4-g64"), 1 << 20, rounds=3, device="cuda")
    assert passes["int8"]["kernels"] == ["cuda_triton_weight_only"]
    prof = build_profile(TINY, weight_specs=("int8",), kv_specs=("bf16", "int8"), min_bytes=1 << 20,
                         log=lambda _: None, bandwidth_bytes=256 << 20, matmul_n=1024, kv_contexts=(16, 64),
                         device="cuda")
    assert torch.cuda.get_device_name() in prof.device.name and prof.measured["device"] == "cuda"
    assert prof.cache_refill_s == 0 and prof.device.memory_bytes > 1e9


LAYER = (("q_proj", (64, 64)), ("k_proj", (64, 64)), ("v_proj", (64, 64)), ("o_proj", (64, 64)),
         ("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128)))


@pytest.mark.parametrize("spec,fused", [("bf16", True), ("int8", True), ("int4-g64", True), ("fp8-e4m3", True),
                                        ("fp8-e4m3-g64", False)])
def test_step_set_makes_the_compiled_steps_calls(spec, fused):
    """The probe's GEMV calls of a layer as the compiled step makes them: q/k/v and gate/up one matmul each where
    `fewbits.decode.fuse` fuses the kernels the dispatcher chose (grouped fp8 does not fuse), the same bytes and the
    same outputs as the layers called one by one (same seeds: the same weights)."""
    from fewbits.bench.gemv import build_step_set

    ws = build_step_set(spec, LAYER, min_bytes=0)
    apart = build_set(spec, tuple(s for _, s in LAYER))
    assert ws.nbytes == apart.nbytes and ws.copies == 1
    if fused:
        assert ws.shapes == ((192, 64), (64, 64), (256, 64), (64, 128))
    else:
        assert ws.shapes == tuple(s for _, s in LAYER)
    x = {k: torch.randn(2, 1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in (64, 128)}
    ref = [k(x[k.shape[1]]) for k in apart.kernels]
    got: list[torch.Tensor] = []
    for call in ws.kernels:
        y = call(x[call.shape[1]])
        got += list(y) if isinstance(y, tuple) else [y]
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    more = build_step_set(spec, LAYER, min_bytes=3 * ws.nbytes)
    assert more.copies == 3 and len(more.kernels) == 3 * len(ws.shapes)
    assert more.kernels[0].fn is not more.kernels[len(ws.shapes)].fn  # copies hold their own weights


DEEP = ModelSpec(name="deep", family="llama", n_layers=12, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256, tie_embeddings=True, max_position_embeddings=4096)


@pytest.mark.parametrize("evict", [True, False])
def test_compiled_steps_evict_the_skeletons_cache_before_each_timed_step(monkeypatch, evict):
    """On the compiled path every timed step follows the eviction of the cache of the decoder it runs (that of
    `decoder_for` at its batch and length: every tensor of every layer), and the figures say so."""
    import types

    import fewbits.decode.generate
    from fewbits.bench import evict as evict_mod
    from fewbits.bench.probe import step_costs
    from fewbits.generate import GenerationResult

    _no_skeleton_rows(monkeypatch)
    caches: dict[tuple, list] = {}

    def fake_decoder(model, kv, batch, max_len):
        key = (str(kv), batch, max_len, len(model.model.layers))
        caches.setdefault(key, [types.SimpleNamespace(t={"k": torch.zeros(2), "v": torch.zeros(2)})
                                for _ in model.model.layers])
        return types.SimpleNamespace(cache=caches[key])

    evicted: list[frozenset[int]] = []
    monkeypatch.setattr(evict_mod, "evictor", lambda ts: (lambda ts=list(ts): evicted.append(frozenset(map(id, ts)))))

    def fake_static(model, ids, n, kv="bf16", between=None):
        b, c = ids.shape
        for _ in range(n - 1):
            if between is not None:
                between()
        return GenerationResult(ids[:, :1], c, 0.0, [1e-3 + 1e-4 * b + 1e-6 * c * len(model.model.layers)])

    monkeypatch.setattr(fewbits.decode.generate, "generate_static", fake_static)
    monkeypatch.setattr(fewbits.decode.generate, "decoder_for", fake_decoder)
    res = step_costs(DEEP, ("bf16",), contexts=(8, 96), steps=8, rounds=1, refill_bytes=0, measure_refill=False,
                     compiled=True, depths=(1, 3), evict=evict)
    assert res["bf16"]["cache_evicted"] is evict
    if not evict:
        assert evicted == [] and caches == {}
        return
    points = res["bf16"]["points"]  # (batch, prompt, bytes, seconds, depth)
    assert len(evicted) == 8 * len(points)  # 8 timed steps a point
    want = {frozenset(id(t) for layer in caches[("bf16", b, c + 9, d)] for t in layer.t.values())
            for b, c, _, _, d in points}
    assert set(evicted) == want and len(want) == len(points)  # a point's decoder each, every layer's k and v
    assert sorted(len(e) for e in evicted) == sorted(2 * d for *_, d in points for _ in range(8))


def test_a_decoder_that_cannot_be_built_leaves_the_steps_unevicted(monkeypatch):
    """Where compiling the step fails (`generate_static` then decodes eagerly and says why), the probe evicts
    nothing and records it, instead of failing on the decoder it wanted the cache of."""
    import fewbits.decode.generate
    from fewbits.bench.probe import step_costs
    from fewbits.generate import GenerationResult

    _no_skeleton_rows(monkeypatch)

    def no_compiler(model, kv, batch, max_len):
        raise RuntimeError("no C++ compiler")

    def fake_static(model, ids, n, kv="bf16", between=None):
        assert between is None
        b, c = ids.shape
        return GenerationResult(ids[:, :1], c, 0.0, [1e-3 + 1e-4 * b + 1e-6 * c * len(model.model.layers)])

    monkeypatch.setattr(fewbits.decode.generate, "generate_static", fake_static)
    monkeypatch.setattr(fewbits.decode.generate, "decoder_for", no_compiler)
    res = step_costs(DEEP, ("bf16",), contexts=(8, 96), steps=8, rounds=1, refill_bytes=0, measure_refill=False,
                     compiled=True, depths=(1, 3))
    assert res["bf16"]["cache_evicted"] is False and res["bf16"]["fixed_s"] > 0


@pytest.mark.parametrize("slow1", [1.0, 1.5])
def test_step_costs_on_shallow_skeletons_scale_the_fixed_costs_to_the_models_depth(monkeypatch, slow1):
    """Compiled steps of 1- and 3-layer skeletons of a 12-layer model: the fixed time per step and per layer,
    per extra sequence and per layer, each cache's extra per layer and per byte are recovered and given for
    12 layers; and only the graphs the fit needs are run (fewer for caches without a window).  Where every
    cache's bytes cost `slow1` x more at batch 1 than at batch 8, that is the batch factor, and the rates are
    batch 8's."""
    import fewbits.decode.generate
    from fewbits.bench.probe import step_costs
    from fewbits.cost.profile import DEFAULT
    from fewbits.cost.step import kv_step_bytes, kv_terms
    from fewbits.generate import GenerationResult
    from fewbits.kvcache.format import parse_kv_format

    kivi = "int4-g16-r16"
    ran: list[tuple[str, int, int, int]] = []
    _no_skeleton_rows(monkeypatch)

    def fake_static(model, ids, n, kv="bf16", between=None):
        b, c = ids.shape
        depth = len(model.model.layers)
        kvf = parse_kv_format(kv)
        ran.append((kvf.spec, b, c, depth))
        spec = ModelSpec(**{**DEEP.__dict__, "n_layers": depth})
        kb = kv_step_bytes(kv_terms(spec, kvf.full_spec, DEFAULT), b, c + n // 2)
        q, w = float(kb["read_q"] + kb["write_q"]), float(kb["read_w"] + kb["write_w"])
        t = 1e-3 + 2e-4 * depth + (1e-4 + 3e-5 * depth) * (b - 1)
        per_byte = slow1 if b == 1 else 1.0
        if kvf.is_quantized:
            extra = {"int8": 4e-5, kivi: 6e-5}[kvf.spec]
            t += extra * depth + per_byte * ({"int8": 2e-9, kivi: 4e-9}[kvf.spec] * q + 3e-9 * w)
            t += 5e-5 * depth * (kvf.residual > 0 and kvf.quantized_tokens(c + n - 1) > 0)
        else:
            t += per_byte * 1e-9 * (q + w)
        return GenerationResult(ids[:, :1], c, 0.0, [t + 1e-4, t])

    monkeypatch.setattr(fewbits.decode.generate, "generate_static", fake_static)
    res = step_costs(DEEP, ("bf16", "int8", kivi), contexts=(8, 96), steps=8, rounds=1, refill_bytes=0,
                     measure_refill=False, compiled=True, depths=(1, 3), evict=False)
    assert res["bf16"]["fixed_s"] == pytest.approx(1e-3 + 2e-4 * 12, rel=1e-6)
    assert res["int8"]["fixed_s"] == pytest.approx(1e-3 + (2e-4 + 4e-5) * 12, rel=1e-6)
    assert res[kivi]["fixed_s"] == pytest.approx(1e-3 + (2e-4 + 6e-5) * 12, rel=1e-6)
    assert res["bf16"]["per_seq_s"] == pytest.approx(1e-4 + 3e-5 * 12, rel=1e-6)
    assert res["bf16"]["s_per_byte"] == pytest.approx(1e-9, rel=1e-6)
    assert res["int8"]["s_per_byte"] == pytest.approx(2e-9, rel=1e-6)
    assert res[kivi]["s_per_byte"] == pytest.approx(4e-9, rel=1e-6)
    assert res[kivi]["window_s_per_byte"] == pytest.approx(3e-9, rel=1e-6)
    assert res[kivi]["quantized_s"] == pytest.approx(5e-5 * 12, rel=1e-6)
    assert res["bf16"]["batch_factor"] == [[1, pytest.approx(slow1, rel=1e-6)], [8, 1.0]]
    fields = step_profile_fields(DEEP, res, 1e9, log=lambda _: None)
    assert fields["kv_batch_factor"] == ((1.0, pytest.approx(slow1, rel=1e-6)), (8.0, 1.0))
    graphs = set(ran)
    assert {(s, d) for s, _, _, d in graphs} == {("bf16", 1), ("bf16", 3), ("int8", 3), (kivi, 3)}
    assert {(b, c) for s, b, c, d in graphs if s == "int8"} == {(1, 96), (8, 96)}  # no window: 2 graphs
    assert len({g for g in graphs if g[0] == kivi}) == 4 and len({g for g in graphs if g[0] == "bf16"}) == 8
    # the 16-bit cache at the shallow depth at the shortest and the longest context: its cost per layer from both
    assert {(b, c) for s, b, c, d in graphs if s == "bf16" and d == 1} == {(1, 8), (8, 8), (1, 96), (8, 96)}


def test_step_set_calls_16_bit_layers_on_the_steps_operator():
    """A 16-bit layer's and a fused 16-bit projection's probe calls at one row run `fewbits_rows::dense_mm`, as
    the compiled step's (`fewbits.decode.step.linear16`), not torch's matmul."""
    from torch.profiler import profile

    from fewbits.bench.gemv import build_step_set
    from fewbits.kernels import rows

    if not rows.enabled():
        pytest.skip(f"no rows operators: {rows.why_not()}")
    ws = build_step_set("bf16", LAYER, min_bytes=0)
    x = {k: torch.randn(1, 1, k).to(torch.bfloat16) for k in (64, 128)}
    for call in ws.kernels:
        with profile() as p:
            call(x[call.shape[1]])
        names = {e.name for e in p.events()}
        assert "fewbits_rows::dense_mm" in names and "aten::linear" not in names, (call.shape, names)


def test_sixteen_bit_peaks_are_at_least_fp32_on_a_cpu_only():
    """A CPU whose 16-bit GEMM is slower than fp32 (no 16-bit units: fewbits' kernels widen to fp32) gets the fp32
    rate for bf16 and fp16; faster 16-bit rates, other precisions and a GPU's rates are kept as measured."""
    slow = {"fp32": 63e9, "bf16": 1e9, "fp16": 1.2e9, "int8": 2e9}
    assert sixteen_bit_peaks(slow, "cpu") == {"fp32": 63e9, "bf16": 63e9, "fp16": 63e9, "int8": 2e9}
    fast = {"fp32": 60e9, "bf16": 900e9, "fp16": 50e9}
    assert sixteen_bit_peaks(fast, "cpu") == {"fp32": 60e9, "bf16": 900e9, "fp16": 60e9}
    assert sixteen_bit_peaks(slow, "cuda") == slow


def test_call_growth_per_extra_row_and_family():
    """A pass's tiny calls growing from 1 to 8 rows (the kernels' own fixed work: packing x, the tiles' drain) is
    charged per call and extra sequence, per family; shrinking (noise) is none; the head and a pass timed at one
    row only give nothing."""
    from fewbits.bench.probe_calls import call_growth

    def p(c1, c8):  # a fused pass: 8 calls where the model counts 14
        return {"kernels": ["k"], "bytes": 1e6, "calls": 8, "rows1": {"t_calls_s": c1}, "rows8": {"t_calls_s": c8}}

    passes = {"bf16": p(1e-4, 1.7e-4), "int8": p(2e-4, 4.8e-4), "fp8-e4m3": p(3e-4, 2e-4),
              "int4-g64": {"kernels": ["k"], "bytes": 1e6, "rows1": {"t_calls_s": 1e-4}},
              "lm_head_bf16": {"bytes": 1e6, "rows1": {"t_s": 1e-4}, "rows8": {"t_s": 3e-4}}}
    g = call_growth(passes, 14, log=lambda _: None)
    # over the model's 14 calls, so that 14 calls x 7 extra rows give back the whole growth
    assert g == {"float": pytest.approx(0.7e-4 / (14 * 7)), "int8": pytest.approx(2.8e-4 / (14 * 7)), "fp8": 0.0}


def test_fastest_of_sweeps_keeps_each_timing_at_its_fastest_and_takes_the_bytes_again():
    """Passes, tiny calls and heads each keep their fastest sweep; the bytes' share is that pass less those calls
    (the whole pass where the sweep says so: a GPU's, a compiled CPU step's); sweeps over other formats, or none,
    are refused."""
    from fewbits.bench.probe_calls import fastest_of_sweeps

    def sweep(t1, c1, h1, t8):
        return {"bf16": {"kernels": ["k"], "bytes": 1e6, "calls": 8,
                         "rows1": {"t_s": t1, "t_calls_s": c1, "t_bytes_s": t1 - c1, "t_head_s": h1, "flops": 1e6},
                         "rows8": {"t_s": t8, "t_calls_s": 1e-4, "t_bytes_s": t8 - 1e-4, "t_head_s": h1,
                                   "flops": 8e6}},
                "lm_head_bf16": {"bytes": 1e5, "rows1": {"t_s": h1}, "rows8": {"t_s": 2 * h1}}}

    slow, quick = sweep(1.2e-3, 1e-4, 3e-4, 2e-3), sweep(1.0e-3, 2e-4, 4e-4, 2.5e-3)
    got = fastest_of_sweeps([slow, quick])
    r1 = got["bf16"]["rows1"]
    assert (r1["t_s"], r1["t_calls_s"], r1["t_head_s"]) == (1.0e-3, 1e-4, 3e-4)
    assert r1["t_bytes_s"] == pytest.approx(0.9e-3) and r1["flops"] == 1e6
    assert got["bf16"]["rows8"]["t_s"] == 2e-3 and got["bf16"]["calls"] == 8
    assert got["lm_head_bf16"]["rows1"]["t_s"] == 3e-4 and got["lm_head_bf16"]["rows8"]["t_s"] == 6e-4
    # the sweeps themselves are left as measured
    assert slow["bf16"]["rows1"]["t_s"] == 1.2e-3 and quick["bf16"]["rows1"]["t_calls_s"] == 2e-4
    whole = [{f: {**r, "whole_pass": True} for f, r in sw.items()} for sw in (slow, quick)]
    assert fastest_of_sweeps(whole)["bf16"]["rows1"]["t_bytes_s"] == 1.0e-3
    assert fastest_of_sweeps([slow]) == slow
    with pytest.raises(ValueError, match="different formats"):
        fastest_of_sweeps([slow, {"int8": quick["bf16"], "lm_head_bf16": quick["lm_head_bf16"]}])
    with pytest.raises(ValueError, match="at least one sweep"):
        fastest_of_sweeps([])


def test_probe_sweeps_the_gemv_passes_and_keeps_the_fastest(monkeypatch):
    """The profile's efficiencies come from each pass's fastest sweep: a slow first sweep of the 16-bit linears
    (a busy moment of the host) does not set the 16-bit family's rate."""
    from fewbits.bench import probe

    bw = _canned(monkeypatch)
    canned = probe.gemv_passes
    calls = []

    def passes(*a, **k):
        out = canned(*a, **k)
        calls.append(len(calls))
        if len(calls) == 1:  # the first sweep found the 16-bit pass 1.5x slower
            r = out["bf16"]["rows1"]
            r["t_s"], r["t_bytes_s"] = r["t_s"] + 1e-3, r["t_bytes_s"] + 1e-3
        return out

    monkeypatch.setattr(probe, "gemv_passes", passes)
    prof = build_profile(TINY, weight_specs=("int8",), kv_specs=("bf16",), log=lambda _: None)
    assert len(calls) == probe.PASS_SWEEPS >= 2
    assert prof.bw_eff("float") == pytest.approx(8e6 / (2e-3 + 1e-4) / bw)  # compiled: the whole pass, its calls in
    sweeps = prof.measured["gemv_sweeps_t_s"]
    assert len(sweeps) == probe.PASS_SWEEPS and sweeps[0]["bf16"]["rows1"] == pytest.approx(3.1e-3)
    # every sweep keeps its compiled passes' graphs in one dict: the next sweep's sets call the same graphs
    assert len(_canned.graphs) == probe.PASS_SWEEPS and all(g is _canned.graphs[0] for g in _canned.graphs)
    assert isinstance(_canned.graphs[0], dict)


def test_probe_reads_memory_again_at_its_end_and_says_when_the_host_moved(monkeypatch):
    """A host whose load changed during the probe is named in its log, and both reads are kept in the profile; a
    steady one gets the plain line."""
    from fewbits.bench import probe

    bw = _canned(monkeypatch)
    lines: list[str] = []
    prof = build_profile(TINY, weight_specs=("int8",), kv_specs=("bf16",), log=lines.append)
    assert prof.measured["bandwidth_end"] == prof.measured["bandwidth"] == bw
    assert "1.00x the start's" in lines[-1] and "moved" not in lines[-1]
    reads = iter([bw, 0.8 * bw])  # the end read 20% slower
    monkeypatch.setattr(probe, "memory_bandwidth", lambda nbytes=0, device="cpu": next(reads))
    lines.clear()
    prof = build_profile(TINY, weight_specs=("int8",), kv_specs=("bf16",), log=lines.append)
    assert prof.measured["bandwidth"] == bw and prof.measured["bandwidth_end"] == pytest.approx(0.8 * bw)
    assert "0.80x the start's" in lines[-1] and "the host moved during the probe" in lines[-1]
    assert prof.device.bandwidth == bw  # the profile's figures stay the start's, which the curve was read beside
