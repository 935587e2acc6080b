"""`fewbits bench` end to end on a tiny architecture with random weights (no checkpoint needed)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fewbits.bench.decode import format_row, run_bench
from fewbits.cost.devices import DeviceSpec
from fewbits.cost.profile import Profile
from fewbits.kernels import choose_kernel

CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "tie_word_embeddings": False}

INT4 = choose_kernel("int4-g64", (64, 128))[0].name  # the dispatcher's int4 kernel on this CPU
INT8 = choose_kernel("int8", (64, 128))[0].name  # and its int8 one


def _tiny(folder) -> tuple:  # noqa: ANN001
    """CONFIG written into `folder`, and a profile of a made-up CPU (a prediction to print, not to check)."""
    path = folder / "config.json"
    path.write_text(json.dumps(CONFIG))
    dev = DeviceSpec(key="t", name="test cpu", memory_bytes=8e9, bandwidth=10e9, peak_flops={"bf16": 1e11})
    return path, Profile(name="t", bandwidth_efficiency={"float": 0.5}, kv_bandwidth_efficiency={"float": 0.5},
                         compute_efficiency={"float": 0.5}, device=dev)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(CONFIG))
    dev = DeviceSpec(key="t", name="test cpu", memory_bytes=8e9, bandwidth=10e9, peak_flops={"bf16": 1e11})
    prof = Profile(name="t", bandwidth_efficiency={"float": 0.5}, kv_bandwidth_efficiency={"float": 0.5},
                   compute_efficiency={"float": 0.5}, overhead_s=1e-3, device=dev)
    out = run_bench(str(path), prof, weights=("bf16", "int8", "int4-g64"), kvs=("bf16", "int8"), batches=(1, 2),
                    prompts=(8,), steps=2, warmup=3, log=lambda _: None, random_weights=True, device="cpu",
                    eager=True)
    return {(r.weights, r.kv, r.batch): r for r in out}


def test_rows_cover_each_axis_alone(rows):
    assert set(rows) == {(w, "bf16", b) for w in ("bf16", "int8", "int4-g64") for b in (1, 2)} | {
        ("bf16", "int8", 1), ("bf16", "int8", 2)}


def test_quantised_weights_run_the_fast_kernels(rows):
    assert rows[("bf16", "bf16", 1)].kernels == "dense"
    assert INT8 in rows[("int8", "bf16", 1)].kernels
    assert INT4 in rows[("int4-g64", "bf16", 1)].kernels


def test_row_figures_are_consistent(rows):
    for r in rows.values():
        assert r.measured_ms > 0 and r.median_ms >= r.measured_ms and r.predicted_ms > 0
        assert r.error_pct == pytest.approx(100 * (r.predicted_ms - r.measured_ms) / r.measured_ms)
        assert r.tokens_per_s == pytest.approx(r.batch * 1e3 / r.measured_ms)
        base = rows[("bf16", "bf16", r.batch)]
        assert r.speedup_vs_16bit == pytest.approx(base.measured_ms / r.measured_ms)
    # the cache's true bytes: 2 layers x (K + V) x 2 KV heads x 16 dims x (8 prompt + 3 untimed + 2 timed
    # new) tokens x batch
    assert rows[("bf16", "bf16", 1)].kv_bytes == 2 * 2 * 2 * 16 * 13 * 2
    assert all(r.warmup == 3 and r.steps == 2 for r in rows.values())
    assert rows[("bf16", "bf16", 2)].kv_bytes == 2 * rows[("bf16", "bf16", 1)].kv_bytes
    assert rows[("bf16", "int8", 1)].kv_bytes < rows[("bf16", "bf16", 1)].kv_bytes



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_on_cuda_runs_the_gpu_kernels(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    dev = DeviceSpec(key="g", name="test gpu", memory_bytes=80e9, bandwidth=1e12, peak_flops={"bf16": 1e14})
    prof = Profile(name="g", bandwidth_efficiency={"float": 0.5}, kv_bandwidth_efficiency={"float": 0.5},
                   compute_efficiency={"float": 0.5}, overhead_s=1e-3, device=dev)
    out = run_bench(str(path), prof, weights=("bf16", "int8", "int4-g64"), kvs=("bf16", "int4"), batches=(1,),
                    prompts=(16,), steps=3, log=lambda _: None, random_weights=True, device="cuda")
    got = {(r.weights, r.kv): r for r in out}
    assert got[("int8", "bf16")].kernels == "cuda_triton_weight_only"
    assert got[("int4-g64", "bf16")].kernels == "cuda_triton_weight_only"
    assert all(r.measured_ms > 0 for r in out)


def test_compiled_rows_report_compile_time_apart(tmp_path, monkeypatch):
    """The default path: the compiled static step, its compile time apart from the step times, and the
    cache's bytes as the eager path's store counts them (KIVI window included)."""
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path / "cache"))
    path, prof = _tiny(tmp_path)
    kw = dict(weights=("int4-g64",), kvs=("int4-g8-r4",), batches=(1,), prompts=(9,), steps=3,
              log=lambda _: None, random_weights=True)
    (row,) = run_bench(str(path), prof, **kw)
    (ref,) = run_bench(str(path), prof, **kw, eager=True)
    assert row.path == "compiled" and row.compile_s > 0 and ref.path == "eager"
    assert row.kv_bytes == ref.kv_bytes
    assert row.measured_ms > 0
    assert any((tmp_path / "cache" / "inductor").rglob("*"))


def test_lm_head_quantised_on_the_quantised_rows_only(tmp_path):
    path, prof = _tiny(tmp_path)
    out = run_bench(str(path), prof, weights=("bf16", "int4-g64"), kvs=("bf16",), batches=(1,), prompts=(8,),
                    steps=2, log=lambda _: None, random_weights=True, lm_head="int8", eager=True)
    got = {r.weights: r for r in out}
    assert got["bf16"].lm_head == "" and got["bf16"].kernels == "dense"
    assert got["int4-g64"].lm_head == "int8" and got["int4-g64"].kernels == ",".join(sorted({INT4, INT8}))
    assert format_row(got["int4-g64"]).lstrip().startswith("int4-g64+h:int8")


def test_a_bench_that_cannot_fit_is_refused_before_loading(monkeypatch):
    from fewbits.bench import decode

    loaded = []
    monkeypatch.setattr(decode, "load_quantized", lambda *a, **k: loaded.append(a))
    prof = Profile(name="t", bandwidth_efficiency={"float": 0.5}, kv_bandwidth_efficiency={"float": 0.5},
                   compute_efficiency={"float": 0.5})
    # Llama-3.1-405B in bf16 and int4: ~1 TB of weights held at once
    with pytest.raises(decode.BenchMemoryError, match=r"llama-3.1-405b.*bf16 8\d\d\.\d GB.*fewer --weights"):
        run_bench("llama-3.1-405b", prof, weights=("bf16", "int4-g128"), random_weights=True, log=lambda _: None)
    assert loaded == []


def test_bench_without_profile_probes_a_built_in_model_without_loading_it(monkeypatch):
    from click.testing import CliRunner

    from fewbits.bench import probe
    from fewbits.cli import main
    from fewbits.models import loading
    from fewbits.models.presets import get_preset

    seen = {}

    class Stop(Exception):
        pass

    def fake_probe(spec, log=print, device="cpu"):
        seen["spec"], seen["device"] = spec, str(device)
        raise Stop

    monkeypatch.setattr(probe, "build_profile", fake_probe)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = CliRunner().invoke(main, ["bench", "llama-3-8b", "--random-weights"])
    assert isinstance(out.exception, Stop)
    assert seen == {"spec": get_preset("llama-3-8b"), "device": "cpu"}


def test_summary_scores_the_speedup_apart_from_the_step_time():
    from fewbits.bench.decode import HEADER, BenchRow, summary

    def row(w, measured, predicted, speedup, pred_speedup):
        return BenchRow(w, "bf16", 1, 128, 8, measured, measured, 1e3 / measured, predicted,
                        100 * (predicted - measured) / measured, speedup, "k", 0, "memory",
                        predicted_speedup=pred_speedup)

    # a host 25% slower than when probed: every step is mispredicted by -20%, every speedup is right
    rows = [row("bf16", 100.0, 80.0, 1.0, 1.0), row("int8", 50.0, 40.0, 2.0, 2.0), row("int4", 40.0, 32.0, 2.5, 2.3)]
    s = summary(rows)
    assert s.startswith("0/3 rows within 15%")
    assert "speedup vs 16-bit predicted within 15% for 2/2 rows (median |error| 4.0%)" in s  # 8% and 0%
    assert "pred vs 16" in HEADER


def test_int8_activations_choose_their_kernels(tmp_path):
    """--activations q8: the rows run the kernels the dispatcher's q8 mode chooses (cpu_q4_a8 and
    cpu_int8_rows_a8 where the CPU has AVX512-VNNI or AVX2, the weight-only ones elsewhere)."""
    from fewbits.cli import main

    path, prof = _tiny(tmp_path)
    out = run_bench(str(path), prof, weights=("int8", "int4-g64"), kvs=("bf16",), batches=(1,), prompts=(8,),
                    steps=2, log=lambda _: None, random_weights=True, eager=True, activations="q8")
    got = {r.weights: r.kernels for r in out}
    assert got == {"int8": choose_kernel("int8", (64, 128), "cpu", "q8")[0].name,
                   "int4-g64": choose_kernel("int4-g64", (64, 128), "cpu", "q8")[0].name}
    res = CliRunner().invoke(main, ["bench", str(path), "--activations", "int4"])
    assert res.exit_code != 0 and "'int4' is not one of '16', 'q8'" in res.output


def test_split_activations_reads_the_a8_suffix():
    from fewbits.bench.decode import split_activations

    assert split_activations("int4-g32+a8") == ("int4-g32", "q8")
    assert split_activations("int4-g32+h:int8+a8") == ("int4-g32+h:int8", "q8")
    assert split_activations("int4-g32:torch") == ("int4-g32:torch", "16")
    assert split_activations("bf16") == ("bf16", "16")
    assert split_activations("int4-a8") == ("int4-a8", "16")  # only the "+a8" suffix counts


def test_bench_reports_the_memory_read_beside_the_probed_profiles(tmp_path, monkeypatch):
    """With a probed profile, `fewbits bench` reads memory as the probe did before and after its rows and prints
    it beside the profile's bandwidth, with a warning past 10% (a shared host drifts between probe and bench), and
    times the probe's fp32 GEMM before them beside the profile's rate, likewise; the JSON keeps the figures.  A
    profile without measured figures prints nothing of them (and times nothing)."""
    from fewbits.bench import decode
    from fewbits.cli import bench as bench_cli
    from fewbits.cli import main
    from fewbits.cost.profile import save_profile

    path, prof = _tiny(tmp_path)
    reads = iter([34e9, 58e9])
    monkeypatch.setattr(bench_cli, "_memory_read", lambda device: next(reads))
    monkeypatch.setattr(bench_cli, "_matmul_rate", lambda device: 150e9)
    monkeypatch.setattr(decode, "run_bench", lambda *a, **k: [])
    monkeypatch.setattr(decode, "summary", lambda rows: "no rows")
    probed = tmp_path / "probed.json"
    save_profile(Profile(name="p", bandwidth_efficiency={"float": 0.5}, kv_bandwidth_efficiency={"float": 0.5},
                         compute_efficiency={"float": 0.5}, device=prof.device,
                         measured={"bandwidth": 60e9, "matmul_flops": {"fp32": 100e9, "bf16": 1e9}}),
                 probed)
    out_json = tmp_path / "rows.json"
    res = CliRunner().invoke(main, ["bench", str(path), "--profile", str(probed), "--json", str(out_json)])
    assert res.exit_code == 0, res.output
    before, after = (ln for ln in res.output.splitlines() if ln.startswith("memory read"))
    assert before.startswith("memory read before the rows: 34.0 GB/s, 0.57x the profile's 60.0 GB/s (the host is")
    assert after == "memory read after the rows: 58.0 GB/s, 0.97x the profile's 60.0 GB/s"
    (compute,) = (ln for ln in res.output.splitlines() if ln.startswith("fp32 matmul"))
    assert compute == ("fp32 matmul before the rows: 150 GFLOP/s, 1.50x the profile's 100 GFLOP/s (rows bound by "
                       "arithmetic, as a CPU's batch-8 steps, move with it)")
    data = json.loads(out_json.read_text())
    assert data["memory_read_bytes_s"] == {"profile": 60e9, "before": 34e9, "after": 58e9}
    assert data["fp32_matmul_flops_s"] == {"profile": 100e9, "before": 150e9}
    # within 10% of the profile's: the rate without the warning
    monkeypatch.setattr(bench_cli, "_memory_read", lambda device: 60e9)
    monkeypatch.setattr(bench_cli, "_matmul_rate", lambda device: 105e9)
    res = CliRunner().invoke(main, ["bench", str(path), "--profile", str(probed)])
    assert res.exit_code == 0 and "fp32 matmul before the rows: 105 GFLOP/s, 1.05x the profile's 100 GFLOP/s\n" \
        in res.output, res.output
    plain = tmp_path / "plain.json"
    save_profile(prof, plain)
    monkeypatch.setattr(bench_cli, "_memory_read", lambda device: pytest.fail("read without a probed bandwidth"))
    monkeypatch.setattr(bench_cli, "_matmul_rate", lambda device: pytest.fail("GEMM without a probed rate"))
    res = CliRunner().invoke(main, ["bench", str(path), "--profile", str(plain)])
    assert res.exit_code == 0 and "memory read" not in res.output and "fp32 matmul" not in res.output, res.output
