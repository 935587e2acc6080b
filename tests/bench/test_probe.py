"""The probe on a tiny model and small buffers: a valid profile that the cost model loads and uses."""

from __future__ import annotations

import math

import pytest

from fewbits.bench.decode import BenchRow, format_row, summary
from fewbits.bench.gemv import build_set, effective_spec
from fewbits.bench.probe import build_profile, layer_shapes
from fewbits.cost.plan import plan
from fewbits.cost.profile import load_profile, save_profile
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
    assert ws.kernel_names == ("cpu_int4pack",)


def _canned(monkeypatch):
    """Replace the timed measurements with hand-set figures so that the assembly is checked exactly."""
    from fewbits.bench import probe

    bw = 10e9
    monkeypatch.setattr(probe, "memory_bandwidth", lambda nbytes=0: bw)
    monkeypatch.setattr(probe, "matmul_rates", lambda n=0: {"fp32": 1e11, "bf16": 5e11, "int8": 1e12})

    def passes(spec, formats, min_bytes):
        out = {}
        for f, (nbytes, t1, t8, tc) in {"bf16": (8e6, 2e-3, 2e-3, 1e-4), "int8": (4e6, 1e-3, 4e-3, 2.4e-4),
                                        "int4-g64": (2e6, 0.8e-3, 0.85e-3, 1e-4)}.items():
            if f in formats:
                out[f] = {"kernels": ["k"], "bytes": nbytes,
                          "rows1": {"t_s": t1 + tc, "t_calls_s": tc, "t_bytes_s": t1, "flops": 1e6},
                          "rows8": {"t_s": t8 + tc, "t_calls_s": tc, "t_bytes_s": t8, "flops": 8e6}}
        out["lm_head_bf16"] = {"bytes": 1e6, "rows1": {"t_s": 1e-3}, "rows8": {"t_s": 2e-3}}
        return out

    monkeypatch.setattr(probe, "gemv_passes", passes)
    # fitted skeleton steps: 20 ms fixed, 1 ms per extra sequence; the int8 cache adds 0.5 ms per layer
    monkeypatch.setattr(probe, "step_costs", lambda spec, kvs, ctx: {
        s: {"fixed_s": a, "per_seq_s": 1e-3, "s_per_byte": 1 / (e * bw), "points": []}
        for s, a, e in (("bf16", 0.02, 0.5), ("int8", 0.021, 0.05)) if s in kvs})
    return bw


def test_probe_assembles_profile_and_plan_uses_it(tmp_path, monkeypatch):
    bw = _canned(monkeypatch)
    prof = build_profile(TINY, weight_specs=("int8", "int4-g64"), kv_specs=("bf16", "int8"), log=lambda _: None)
    assert prof.bw_eff("float") == pytest.approx((8e6 + 1e6) / (2e-3 + 1e-3) / bw)  # body + LM head
    assert prof.bw_eff("int8") == pytest.approx(4e6 / 1e-3 / bw)
    assert prof.bw_eff("int4") == pytest.approx(2e6 / 0.8e-3 / bw)
    # int8 takes 4x longer at 8 rows: compute-limited; (8e6 body + 2*8*256*64 head FLOPs) / (6 ms * 5e11)
    assert prof.compute_eff("int8") == pytest.approx((8e6 + 2 * 8 * 256 * 64) / (6e-3 * 5e11))
    assert "int4" not in prof.compute_efficiency  # 0.85 ms vs 0.8 ms: still memory-bound
    assert prof.kv_eff("int8") == pytest.approx(0.05) and prof.overhead_s == 0.02
    assert prof.overhead_per_seq_s == 1e-3
    assert prof.kv_overhead("int8") == pytest.approx(0.001 / TINY.n_layers)
    # int8 kernel calls take 0.14 ms longer than 16-bit ones over 7 linears x 2 layers
    assert prof.call_overhead("int8") == pytest.approx(1.4e-4 / 14) and prof.call_overhead("int4") == 0
    assert prof.device is not None and prof.device.peak_flops["int8"] == 1e12 and prof.low_precision_compute
    layer = ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    assert layer_shapes(TINY) == layer
    path = tmp_path / "p.json"
    save_profile(prof, path)
    loaded = load_profile(str(path))
    assert all(loaded.bw_eff(f) == prof.bw_eff(f) for f in prof.bandwidth_efficiency)
    assert loaded.device == prof.device
    r = plan(TINY, batch=1, context=128, weights="int8", kv="int8-g16", profile=loaded,
             table_weights=None, table_kv=None)
    assert r.device == prof.device.name and math.isfinite(r.time_s)
    assert r.time_s > prof.overhead_s  # overhead plus a positive memory time
    # the overhead the step adds: fixed + the int8 weights' extra per call + the int8 cache's per layer
    assert r.overhead_s == pytest.approx(0.02 + 14 * 1e-5 + 2 * 5e-4)
    r8 = plan(TINY, batch=8, context=128, weights="int8", kv="int8-g16", profile=loaded,
              table_weights=None, table_kv=None)
    assert r8.overhead_s == pytest.approx(r.overhead_s + 7e-3)


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


def test_step_costs_fit_recovers_fixed_per_sequence_and_per_byte_costs(monkeypatch):
    import fewbits.generate
    from fewbits.bench.probe import step_costs
    from fewbits.cost.profile import DEFAULT
    from fewbits.cost.step import kv_terms
    from fewbits.generate import GenerationResult
    from fewbits.kvcache.format import parse_kv_format

    def fake_generate(model, ids, n, kv="bf16"):  # a step costs 5 ms + 2 ms per extra sequence + 1 ns/byte
        b, c = ids.shape
        per_token = kv_terms(TINY, parse_kv_format(kv).cost_format(TINY.head_dim), DEFAULT).per_token
        t = 5e-3 + 2e-3 * (b - 1) + 1e-9 * b * (c + n // 2) * per_token
        return GenerationResult(ids[:, :1], c, 0.0, [t + 1e-3, t, t + 2e-3])

    monkeypatch.setattr(fewbits.generate, "generate", fake_generate)
    res = step_costs(TINY, ("bf16", "int4"), contexts=(32, 96), steps=8)
    for r in res.values():
        assert r["fixed_s"] == pytest.approx(5e-3, rel=1e-6)
        assert r["per_seq_s"] == pytest.approx(2e-3, rel=1e-6)
        assert r["s_per_byte"] == pytest.approx(1e-9, rel=1e-6)
        assert len(r["points"]) == 4
