"""Which kernels the api prepares: by default a quantised or reloaded model runs on the dispatcher's fast
paths (int4 / int8 packed CPU kernels), quality measurements ask for the exact dequantised weights by
name, and `fewbits quantize`, which only saves, packs no fast kernel at all."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fewbits import api
from fewbits.kernels import choose_kernel, cpu, cpu_rows, rows
from fewbits.models.qlinear import QuantLinear, kernel_name
from fewbits.models.recipe import Recipe
from fewbits.tensor import quantize_tensor

# the dispatcher's first int4 kernel on this CPU: fewbits' own operator, or torch's where it declines
FAST = {"int4-g32": choose_kernel("int4-g32", (64, 128))[0].name,
        "int8": (cpu_rows.Int8RowsKernel if rows.enabled() else cpu.Int8PackKernel).name}


def _kernels(model: torch.nn.Module) -> list[str]:
    return [getattr(m.kernel, "name", type(m.kernel).__name__) for m in model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("spec", ["int4-g32", "int8"])
def test_default_on_quantize_is_the_dispatcher(tiny, spec):
    api.quantize(tiny, spec, progress=False)
    assert _kernels(tiny) == [FAST[spec]] * 14  # every layer packed for the CPU fast path, none "reference"


@pytest.mark.parametrize("spec", ["int4-g32", "int8"])
def test_default_on_load_is_the_dispatcher(tiny_factory, tmp_path, spec):
    recipe = Recipe.from_format(spec)
    exact, fast = tiny_factory(), tiny_factory()
    api.quantize(exact, recipe, progress=False, chooser=api.kernel_chooser("cached"))
    api.quantize(fast, recipe, progress=False, chooser=api.kernel_chooser("auto"))
    out = api.save_quantized_model(exact, recipe, tmp_path / "q")
    again, _, _ = api.load_quantized_model(out)
    assert _kernels(again) == [FAST[spec]] * 14
    assert api.kernels_in_use(again) == {FAST[spec]: 14}
    ids = torch.arange(24)[None] % 128
    with torch.no_grad():
        assert torch.equal(again(ids).logits, fast(ids).logits)  # same kernels on the same stored bytes
        cached, _, _ = api.load_quantized_model(out, chooser=api.kernel_chooser("cached"))
        assert torch.equal(cached(ids).logits, exact(ids).logits)


@pytest.mark.parametrize("name", ["cached", "reference", "auto"])
def test_explicit_choice_by_name_or_chooser(tiny_factory, tmp_path, name):
    want = {"cached": "cached", "reference": "reference", "auto": FAST["int4-g32"]}[name]
    a, b = tiny_factory(), tiny_factory()
    recipe = Recipe.from_format("int4-g32")
    api.quantize(a, recipe, progress=False, chooser=name)
    api.quantize(b, recipe, progress=False, chooser=api.kernel_chooser(name))
    assert api.kernels_in_use(a) == api.kernels_in_use(b) == {want: 14}
    out = api.save_quantized_model(a, recipe, tmp_path / "q")
    assert api.kernels_in_use(api.load_quantized_model(out, chooser=name)[0]) == {want: 14}


def test_exact_choices_give_the_dequantised_weights_and_auto_is_close(tiny_factory):
    models = {}
    for name in ("reference", "cached", "auto"):
        models[name] = tiny_factory()
        api.quantize(models[name], "int4-g32", progress=False, chooser=name)
    ids = torch.arange(32)[None] % 128
    with torch.no_grad():
        lg = {k: m(ids).logits for k, m in models.items()}
    assert torch.equal(lg["cached"], lg["reference"])
    assert not torch.equal(lg["auto"], lg["reference"])  # bf16 activations on the fast path
    assert (lg["auto"] - lg["reference"]).abs().max() < 0.02 * lg["reference"].abs().max()


SEEN: list[str] = []


def watch_runner(model, layers, data, commit, progress):
    """RTN that records the kernel of each layer right after it is committed."""
    for p in layers:
        commit(p.name, quantize_tensor(model.get_submodule(p.name).weight.detach(), p.format))
        SEEN.append(kernel_name(model.get_submodule(p.name).kernel))
    return {}


def test_layers_run_the_reference_path_while_the_method_runs(tiny, monkeypatch):
    monkeypatch.setitem(api.METHODS, "watch", api.MethodEntry(f"{__name__}:watch_runner"))
    SEEN.clear()
    api.quantize(tiny, Recipe.from_format("int4-g32", method="watch"), progress=False)
    assert SEEN == ["reference"] * 14  # calibration passes through committed layers stay exact
    assert api.kernels_in_use(tiny) == {FAST["int4-g32"]: 14}  # then the dispatcher, once, at the end


def test_use_kernels_switches_a_finished_model(tiny):
    api.quantize(tiny, "int8", progress=False, chooser="reference")
    assert api.use_kernels(tiny, "cached") == {"cached": 14}
    assert api.use_kernels(tiny) == {FAST["int8"]: 14}
    with pytest.raises(ValueError, match="unknown kernel choice 'fast'"):
        api.use_kernels(tiny, "fast")


def test_cli_quantize_packs_no_fast_kernel(tiny_factory, tmp_path, monkeypatch):
    import fewbits.kernels.dispatch as dispatch
    import fewbits.models.loading as loading
    from fewbits.cli import main

    packed = []
    real = dispatch.prepare_linear
    monkeypatch.setattr(dispatch, "prepare_linear", lambda qt, *a, **k: packed.append(qt.shape) or real(qt, *a, **k))
    api.quantize(tiny_factory(), "int4-g32", progress=False)  # the api's default packs every layer
    assert len(packed) == 14
    packed.clear()
    monkeypatch.setattr(loading, "load_model", lambda name, dtype="fp32": (tiny_factory(), None))
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "-o", str(tmp_path / "q"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert packed == []  # only quantised and saved
    again, _, _ = api.load_quantized_model(tmp_path / "q")
    assert len(packed) == 14 and api.kernels_in_use(again) == {FAST["int4-g32"]: 14}


def test_quantize_cli_lm_head(tmp_path, monkeypatch, tiny_factory):
    from fewbits.cli import main
    from fewbits.models import loading

    monkeypatch.setattr(loading, "load_model", lambda name, dtype="fp32": (tiny_factory(), None))
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--lm-head", "int8", "-o",
                                  str(tmp_path / "q"), "--quiet"])
    assert r.exit_code == 0, r.output
    again, _, _ = api.load_quantized_model(tmp_path / "q")
    assert api.kernels_in_use(again) == {FAST["int4-g32"]: 14, FAST["int8"]: 1}  # 14 linears + the head
    (tmp_path / "r.json").write_text(json.dumps(Recipe.from_format("int8").to_dict()))
    r = CliRunner().invoke(main, ["quantize", "tiny", "--recipe", str(tmp_path / "r.json"), "--lm-head", "int8",
                                  "-o", str(tmp_path / "q2")])
    assert r.exit_code != 0 and "names the head in its own rules" in r.output
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--lm-head", "int5-g7x", "-o",
                                  str(tmp_path / "q3")])
    assert r.exit_code != 0 and "int5-g7x" in r.output and not (tmp_path / "q3").exists()
