"""`fewbits quantize --budget`: the saved model, its recipe file and budget.json agree; bad input is named."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fewbits.cli import main
from fewbits.models import loading
from fewbits.models.recipe import Recipe


@pytest.fixture
def patched(monkeypatch, tiny_llama, tiny_tokenizer):
    class Tok(type(tiny_tokenizer)):
        def save_pretrained(self, path) -> None:  # noqa: ANN001
            pass

    monkeypatch.setattr(loading, "load_model", lambda name, dtype="fp32": (tiny_llama, Tok()))


def test_budget_writes_model_recipe_and_figures(patched, tmp_path) -> None:
    out = tmp_path / "mix"
    r = CliRunner().invoke(main, ["quantize", "tiny", "--budget", "bpw=4.5", "--candidates", "int3-g64,int4-g64,int8",
                                  "--calib-windows", "8", "--calib-seq-len", "32", "--device", "h100", "-o", str(out),
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    assert "budget bpw=4.5" in r.output and "predicted decode step" in r.output
    figures = json.loads((out / "budget.json").read_text())
    recipe = Recipe.load(out / "recipe.toml")
    meta = json.loads((out / "fewbits.json").read_text())
    assert Recipe.from_dict(meta["recipe"]) == recipe
    planned = {p.name: p.format for p in recipe.plan([(n, tuple(s)) for n, s in
                                                      ((r["name"], r["shape"]) for r in meta["report"]["layers"])])
               if p.action == "quantize"}
    assert planned == figures["formats"]
    assert meta["report"]["bits_per_weight"] == pytest.approx(figures["bits_per_weight"]) and figures[
        "bits_per_weight"] <= 4.5


@pytest.mark.parametrize(("args", "why"), [
    (["--budget", "bpw=4", "--format", "int4-g64"], "without --format"),
    (["--candidates", "int4-g64"], "go with --budget"),
    (["--budget", "bits=4"], "write bpw="),
    (["--budget", "bpw=4", "--method", "smoothquant", "--candidates", "int8"], "--budget works with methods"),
])
def test_bad_budget_options_are_refused_before_any_work(patched, tmp_path, args: list[str], why: str) -> None:
    r = CliRunner().invoke(main, ["quantize", "tiny", *args, "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and why in r.output
    assert not (tmp_path / "x").exists()
