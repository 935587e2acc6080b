"""quantize / save_quantized_model / load_quantized_model on a tiny random Llama: plans, reports,
the method plug-in contract, exact reloads, and failures that change and write nothing."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from fewbits import api
from fewbits.formats.format import parse_format
from fewbits.models.qlinear import QuantLinear
from fewbits.models.recipe import Recipe, RecipeError
from fewbits.models.swap import linear_layers, model_nbytes
from fewbits.tensor import quantize_tensor

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(m):
    with torch.inference_mode():
        return m(input_ids=IDS).logits


def test_quantize_report_sizes_and_layers(tiny):
    before = model_nbytes(tiny)
    rep = api.quantize(tiny, "int4-g32", progress=False)
    q = [n for n, m in tiny.named_modules() if isinstance(m, QuantLinear)]
    assert len(q) == 14 and not [n for n, _ in linear_layers(tiny) if n != "lm_head"]
    assert rep.size_before == before and rep.size_after == model_nbytes(tiny)
    # 4 bits + one fp16 scale per 32 weights = 4.5 bits/weight exactly
    assert rep.bits_per_weight == pytest.approx(4.5)
    linear_bytes = sum(r["bytes_before"] for r in rep.quantized_layers)
    assert rep.size_before - rep.size_after == linear_bytes - linear_bytes * 4.5 / 32
    assert "model size" in rep.text() and "14 quantize int4-g32 (rtn)" in rep.text()
    assert json.loads(json.dumps(rep.to_dict()))["layers"][0]["format"] == "int4-g32"


def test_misfit_error_changes_nothing_keep_and_regroup_are_reported(tiny_factory):
    m = tiny_factory(hidden=48)  # 48 columns: groups of 32 do not divide; 96 (mlp in) does
    ref = logits(m)
    with pytest.raises(RecipeError, match=r"(?s)12 layer\(s\) do not fit.*model.layers.0.self_attn.q_proj.*48"):
        api.quantize(m, Recipe.from_format("int4-g32"), progress=False)
    assert not any(isinstance(x, QuantLinear) for x in m.modules())
    assert torch.equal(logits(m), ref)
    rep = api.quantize(m, Recipe.from_format("int4-g32", misfit="regroup"), progress=False)
    fmts = {r["name"].split(".")[-1]: r["format"] for r in rep.layers if r["action"] == "quantize"}
    assert fmts["q_proj"] == "int4-g24" and fmts["down_proj"] == "int4-g32"
    assert "regrouped" in rep.text()
    m2 = tiny_factory(hidden=48)
    rep2 = api.quantize(m2, Recipe.from_format("int4-g32", misfit="keep"), progress=False)
    assert sum(r["action"] == "keep" for r in rep2.layers) == 12
    assert "kept 16-bit" in rep2.text()
    assert isinstance(m2.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(m2.model.layers[0].mlp.up_proj, torch.nn.Linear)


def test_unknown_method_and_missing_data_fail_before_any_change(tiny, monkeypatch):
    with pytest.raises(RecipeError, match="unknown method.*nosuch"):
        api.quantize(tiny, Recipe.from_format("int8", method="nosuch"), progress=False)
    monkeypatch.setitem(api.METHODS, "needy", api.MethodEntry("fewbits.api:run_rtn", needs_data=True))
    with pytest.raises(RecipeError, match="needy needs calibration data"):
        api.quantize(tiny, Recipe.from_format("int8", method="needy"), progress=False)
    assert not any(isinstance(x, QuantLinear) for x in tiny.modules())


def watching_runner(model, layers, data, commit, progress):
    """A plug-in method: RTN, checking that every committed layer's float weight is freed at once."""
    from fewbits.tensor import quantize_tensor

    refs = []
    for p in layers:
        w = model.get_submodule(p.name).weight
        refs.append(weakref.ref(w))
        qt = quantize_tensor(w.detach(), p.format)
        del w
        commit(p.name, qt)
        assert all(r() is None for r in refs), "a float weight outlived its commit"  # freed by refcount
    return {"layers_seen": len(layers), "data_rows": None if data is None else int(data.shape[0])}


def test_method_plugin_contract(tiny, monkeypatch):
    monkeypatch.setitem(api.METHODS, "watch", api.MethodEntry(f"{__name__}:watching_runner"))
    data = torch.zeros(3, 8, dtype=torch.long)
    rep = api.quantize(tiny, Recipe.from_format("int8", method="watch"), data=data, progress=False)
    assert rep.method_info == {"watch": {"layers_seen": 14, "data_rows": 3}}


def lazy_runner(model, layers, data, commit, progress):
    commit(layers[0].name, model.get_submodule(layers[0].name))  # commits one layer as a ready module
    return None


def test_runner_that_skips_layers_is_an_error(tiny, monkeypatch):
    monkeypatch.setitem(api.METHODS, "lazy", api.MethodEntry(f"{__name__}:lazy_runner"))
    with pytest.raises(RecipeError, match="did not quantise 13 planned layer"):
        api.quantize(tiny, Recipe.from_format("int8", method="lazy"), progress=False)


@pytest.mark.parametrize("spec", ["int4-g32-asym", "nvfp4", "int8"])
def test_save_load_identical_logits(tiny, tmp_path, spec):
    recipe = Recipe.from_format(spec)
    rep = api.quantize(tiny, recipe, progress=False)
    want = logits(tiny)
    out = api.save_quantized_model(tiny, recipe, tmp_path / "q", report=rep, source="tiny")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "fewbits-manifest.json", "fewbits.json",
                                                        "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no temporary directory left
    m2, tok, meta = api.load_quantized_model(out)
    assert tok is None and meta["source"] == "tiny" and meta["recipe"] == recipe.to_dict()
    assert torch.equal(logits(m2), want)
    assert m2.lm_head.weight is m2.model.embed_tokens.weight  # still tied
    assert model_nbytes(m2) == model_nbytes(tiny)
    # the file holds the tied embedding once: about the model's true size
    size = (out / "model.safetensors").stat().st_size
    assert model_nbytes(tiny) < size < model_nbytes(tiny) + 64_000


def test_save_refuses_existing_and_failed_save_writes_nothing(tiny, tmp_path, monkeypatch):
    recipe = Recipe.from_format("int8")
    api.quantize(tiny, recipe, progress=False)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        api.save_quantized_model(tiny, recipe, tmp_path / "q")
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        api.save_quantized_model(tiny, recipe, tmp_path / "new")
    with pytest.raises(OSError, match="fewbits did not write"):  # not a fewbits output: never replaced
        api.save_quantized_model(tiny, recipe, tmp_path / "q", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
    assert (tmp_path / "q" / "keep.txt").read_text() == "mine"  # the old directory is untouched
    monkeypatch.undo()
    api.save_quantized_model(tiny, recipe, tmp_path / "saved")
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "saved").iterdir())
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):  # an earlier fewbits output: replaced only when whole
        api.save_quantized_model(tiny, recipe, tmp_path / "saved", overwrite=True)
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "saved").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "saved"]


def test_missing_and_corrupt_files_are_clear_errors(tiny, tmp_path):
    recipe = Recipe.from_format("int4-g32")
    api.quantize(tiny, recipe, progress=False)
    out = api.save_quantized_model(tiny, recipe, tmp_path / "q")
    wf = out / "model.safetensors"
    data = wf.read_bytes()
    wf.write_bytes(data[: len(data) // 2])
    with pytest.raises(api.SavedModelError, match="manifest says .*truncated"):
        api.load_quantized_model(out)
    manifest = (out / "fewbits-manifest.json").read_bytes()
    (out / "fewbits-manifest.json").unlink()  # a folder saved before manifests: the file's own check
    with pytest.raises(api.SavedModelError, match="corrupt weight file"):
        api.load_quantized_model(out)
    (out / "fewbits-manifest.json").write_bytes(manifest)
    wf.unlink()
    with pytest.raises(api.SavedModelError, match="model.safetensors: listed in the manifest but missing"):
        api.load_quantized_model(out)
    with pytest.raises(api.SavedModelError, match="no such directory"):
        api.load_quantized_model(tmp_path / "nothing")
    (out / "fewbits.json").write_text("{")
    with pytest.raises(api.SavedModelError, match="corrupt metadata"):
        api.load_quantized_model(out)


def test_load_detects_tampered_codes(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    recipe = Recipe.from_format("int4-g32")
    api.quantize(tiny, recipe, progress=False)
    out = api.save_quantized_model(tiny, recipe, tmp_path / "q")
    t = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.qweight_codes"
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, out / "model.safetensors")
    with pytest.raises(api.SavedModelError, match="manifest says"):
        api.load_quantized_model(out)
    (out / "fewbits-manifest.json").unlink()  # without the manifest, the shapes still give it away
    with pytest.raises(api.SavedModelError, match="up_proj.*codes"):
        api.load_quantized_model(out)


def test_kernel_choosers():
    assert api.kernel_chooser("reference").__name__ == "reference_chooser"
    assert api.DEFAULT_KERNEL == "auto" and api.kernel_chooser(api.DEFAULT_KERNEL).__name__ == "prepare_linear"
    with pytest.raises(ValueError, match="unknown kernel choice 'fast'"):
        api.kernel_chooser("fast")


@pytest.mark.parametrize("method, spec", [("gptq", "int4-g32"), ("awq", "int4-g32"), ("hqq", "int4-g32-asym"),
                                          ("smoothquant", "int8"), ("llm-int8", "int8")])
def test_every_listed_method_plugs_in(tiny, method, spec):
    data = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(2))
    rep = api.quantize(tiny, Recipe.from_format(spec, method=method), data=data, progress=False)
    assert len(rep.quantized_layers) == 14 and {r["method"] for r in rep.quantized_layers} == {method}
    assert torch.isfinite(logits(tiny)).all()


def test_calibration_windows_come_from_the_calibration_texts(tiny_tokenizer):
    from fewbits.cli.quantize import calibration_ids
    from fewbits.data.texts import load_texts

    ids = calibration_ids(tiny_tokenizer, 64, 5)
    assert ids.shape == (5, 64) and ids.dtype == torch.long
    calib = load_texts("calib")
    first = tiny_tokenizer.decode(ids[0].tolist())
    assert first[:20] in calib["verse"] and first[:20] not in load_texts("eval")["verse"]


@pytest.mark.parametrize("spec", ["int4-g32", "int8"])
def test_kernel_dispatcher_plugs_into_quantlinear(tiny_factory, spec):
    a, b = tiny_factory(), tiny_factory()
    api.quantize(a, spec, progress=False, chooser=api.kernel_chooser("reference"))
    api.quantize(b, spec, progress=False, chooser=api.kernel_chooser("auto"))
    la, lb = logits(a), logits(b)
    assert (la - lb).abs().max() < 0.02 * la.abs().max()  # fast paths may round activations to bf16


def test_quantised_tied_head_saves_and_reloads_exactly(tmp_path, tiny_factory):
    """A head tied to the embedding quantised in its own format: the embedding keeps its 16-bit rows,
    the head is a packed copy, and the saved model reloads to the same logits."""
    model = tiny_factory(tie=True)
    emb = model.model.embed_tokens.weight.detach().clone()
    recipe = Recipe.from_format("int4-g32", lm_head="int8")
    api.quantize(model, recipe, progress=False, chooser=api.kernel_chooser("reference"))
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt_spec == "int8"
    assert torch.equal(model.model.embed_tokens.weight, emb)  # the lookups still read the 16-bit rows
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    api.save_quantized_model(model, recipe, tmp_path / "q")
    loaded = api.load_quantized_model(tmp_path / "q", chooser="reference")
    loaded = loaded[0] if isinstance(loaded, tuple) else loaded
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    assert torch.equal(loaded.model.embed_tokens.weight, emb)


def _as_saved_before_the_full_grid(node):
    """fewbits.json as the code before the full grid wrote it: symmetric integer formats as version 1 dicts
    without "grid", spelled without -narrow (the grid they had then), the recipe's specs likewise."""
    if isinstance(node, dict):
        if node.get("kind") == "int" and "grid" in node:
            assert node.pop("grid") == "narrow" and node["version"] == 3
            return {**node, "version": 1, "spec": node["spec"].replace("-narrow", "")}
        return {k: _as_saved_before_the_full_grid(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_saved_before_the_full_grid(v) for v in node]
    return node.replace("-narrow", "") if isinstance(node, str) else node


def test_a_model_saved_before_the_full_grid_loads_on_its_narrow_grid(tiny, tmp_path):
    recipe = Recipe.from_format("int4-g32-narrow")
    api.quantize(tiny, recipe, progress=False, chooser="cached")
    want = logits(tiny)
    out = api.save_quantized_model(tiny, recipe, tmp_path / "q")
    meta_file = out / "fewbits.json"
    old = _as_saved_before_the_full_grid(json.loads(meta_file.read_text()))
    assert "narrow" not in json.dumps(old) and '"grid"' not in json.dumps(old)
    meta_file.write_text(json.dumps(old))
    (out / "fewbits-manifest.json").unlink()  # saves of that time had no manifest
    m2, _, _ = api.load_quantized_model(out, chooser="cached")
    fmts = {m.qweight.fmt for m in m2.modules() if isinstance(m, QuantLinear)}
    assert fmts == {parse_format("int4-g32-narrow")}
    assert torch.equal(logits(m2), want)
    # re-quantised in the format it was loaded with, a weight stays on the narrow grid (codes 1..15)
    qt = next(m.qweight for m in m2.modules() if isinstance(m, QuantLinear))
    assert int(quantize_tensor(qt.dequantize(), qt.fmt).unpacked_codes().min()) >= 1
