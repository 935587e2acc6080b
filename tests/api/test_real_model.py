"""The packaged SmolLM2-135M: perplexity against plain transformers, the KL ordering of formats,
exact save/reload, size on disk, and the command line's errors that write nothing.

Budget: one 256-token window per text category (verse, prose, code), float32, reference
log-probs computed once per session."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from fewbits import api
from fewbits.cli import main
from fewbits.eval.perplexity import compare, reference_perplexity
from fewbits.formats.format import parse_format

pytestmark = pytest.mark.slow


def test_perplexity_equals_transformers_own_loss(smollm2, smol_windows):
    model, _ = smollm2
    wins, cache, protocol = smol_windows
    assert protocol.windows_per_category == {"verse": 1, "prose": 1, "code": 1} and not protocol.bos
    ours = reference_perplexity(wins, cache)["overall"]["ppl"]  # from the log-probs the comparisons use
    with torch.no_grad():
        losses = [model(input_ids=w.ids[None], labels=w.ids[None]).loss.item() for w in wins]
    theirs = math.exp(sum(losses) / len(losses))  # equal windows: the mean of means is the token mean
    assert abs(ours - theirs) / theirs < 5e-5, (ours, theirs)  # equal to 4 significant digits
    assert 5 < ours < 60  # a sane perplexity for a 135M instruct model on these texts


def test_kl_ordering_of_formats(smol_windows, smol_quantized):
    wins, cache, _ = smol_windows
    kl = {}
    for spec in ("int8", "int4-g32", "int4-g64", "int3-g64"):
        model, _ = smol_quantized(spec, keep=spec == "int4-g64")
        res = compare(model, None, wins, ref_cache=cache, progress=False)["overall"]
        del model
        kl[spec] = res["kl_mean"]
        assert res["kl_p99"] >= res["kl_mean"] and 0 < res["top1"] <= 1
    assert kl["int8"] < kl["int4-g32"] < kl["int4-g64"] < kl["int3-g64"], kl
    assert kl["int8"] < 0.01, kl


def test_save_reload_identical_logits_and_size_on_disk(smollm2, smollm2_dir, smol_windows, smol_quantized,
                                                      tmp_path):
    wins, _, _ = smol_windows
    model, report = smol_quantized("int4-g64")
    out = api.save_quantized_model(model, api.Recipe.from_format("int4-g64"), tmp_path / "q", smollm2[1],
                                   report=report, source=str(smollm2_dir))
    # exact dequantised weights on both sides (smol_quantized uses "cached"): this checks the saved bytes,
    # not the kernels (the default on load, the dispatcher, is tested in test_kernel_defaults.py)
    again, tok, meta = api.load_quantized_model(out, chooser=api.kernel_chooser("cached"))
    ids = wins[0].ids[None, :64]
    with torch.inference_mode():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert tok is not None and meta["report"]["bits_per_weight"] == pytest.approx(4.25)
    # on disk: exactly the formats' bytes for the 210 quantised linears + float32 for the rest
    fmt = parse_format("int4-g64")
    q_bytes = sum(fmt.nbytes(tuple(r["shape"])) for r in report.quantized_layers)
    assert len(report.quantized_layers) == 210
    rest = report.size_before - sum(r["bytes_before"] for r in report.quantized_layers)
    size = (out / "model.safetensors").stat().st_size
    assert q_bytes + rest < size < (q_bytes + rest) * 1.001
    orig = (smollm2_dir / "model.safetensors").stat().st_size
    linear = sum(r["bytes_before"] for r in report.quantized_layers)
    expected_ratio = (linear + rest) / (linear * 4.25 / 32 + rest)  # fp32 -> 4.25 bits/weight for linears
    assert orig / size == pytest.approx(expected_ratio, rel=0.002)
    assert orig / size > 2.4


def test_cli_misfit_is_an_error_naming_layers_and_writes_nothing(smollm2_dir, tmp_path):
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", str(smollm2_dir), "--format", "int4-g128", "-o", str(out), "--quiet"])
    assert r.exit_code != 0
    assert "model.layers.0.self_attn.q_proj" in r.output and "576" in r.output and "--misfit" in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_cli_broken_model_dir_is_an_error_and_writes_nothing(smollm2_dir, tmp_path, damage):
    broken = tmp_path / "model"
    shutil.copytree(smollm2_dir, broken)
    wf = broken / "model.safetensors"
    if damage == "missing":
        wf.unlink()
    else:
        wf.write_bytes(wf.read_bytes()[:100_000])
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", str(broken), "--format", "int8", "-o", str(out), "--quiet"])
    assert r.exit_code != 0 and "model.safetensors" in r.output, r.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_cli_quantize_regroup_then_eval(smollm2_dir, tmp_path):
    # a recipe file: block 0 in int4-g128 (its 576-wide layers regrouped to 96), block 1's MLP in int8
    recipe = tmp_path / "r.toml"
    recipe.write_text('misfit = "error"\n[[rules]]\npattern = "layers\\\\.0\\\\."\nformat = "int4-g128"\n'
                      '[[rules]]\npattern = "layers\\\\.1\\\\.mlp"\nformat = "int8"\n')
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", str(smollm2_dir), "--recipe", str(recipe), "--misfit", "regroup",
                                  "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "6 quantize int4-g96 (rtn), 1 quantize int4-g128 (rtn)" in r.output, r.output
    assert "3 quantize int8 (rtn)" in r.output and "regrouped" in r.output and "bytes ->" in r.output
    j, p = tmp_path / "r.json", tmp_path / "kl.png"
    r = CliRunner().invoke(main, ["eval", str(out), "--seq-len", "128", "--windows", "1", "--json", str(j),
                                  "--plot", str(p), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "protocol: 3 non-overlapping windows of 128 tokens" in r.output and "KL mean" in r.output
    import json

    row = json.loads(j.read_text())["rows"][0]
    assert 0 < row["overall"]["kl_mean"] < 0.2 and set(row["categories"]) == {"verse", "prose", "code"}
    assert p.read_bytes()[:4] == b"\x89PNG"
    # an empty text file: a clear error, nothing written
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    j2 = tmp_path / "r2.json"
    r = CliRunner().invoke(main, ["eval", str(out), "--text", str(empty), "--json", str(j2), "--quiet"])
    assert r.exit_code != 0 and "empty" in r.output and str(empty.name) in r.output, r.output
    assert not j2.exists()


def test_cli_demo_small_budget_writes_report(smollm2_dir, tmp_path):
    out = tmp_path / "demo"
    r = CliRunner().invoke(main, ["demo", "--model", str(smollm2_dir), "--formats", "int8", "--seq-len", "64",
                                  "--dtype", "fp32", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "cost model" in r.output and "quality against the unquantised model" in r.output
    import json

    d = json.loads((out / "results.json").read_text())
    assert [row["format"] for row in d["rows"]] == ["int8"] and d["rows"][0]["overall"]["kl_mean"] < 0.05
    assert "![KL against bits per weight](kl_vs_bits.png)" in (out / "report.md").read_text()
    assert (out / "kl_vs_bits.png").read_bytes()[:4] == b"\x89PNG"
