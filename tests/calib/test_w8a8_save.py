"""Saving and loading models with activation-quantising layers: SmoothQuant W8A8 (`ActQuantLinear` around a
`QuantLinear`) and LLM.int8() (`Int8OutlierLinear`).  The saved metadata describes each layer (kind and
parameters: act_bits, outlier_threshold) and loading rebuilds the same modules: identical logits on a tiny
Llama and on the packaged SmolLM2-135M (its first two blocks quantised, to keep CI time low).  Old
version-1 files still load; unknown layer kinds and broken descriptions are clear errors naming the layer."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fewbits import api
from fewbits.methods.llm_int8 import Int8OutlierLinear, outlier_dims
from fewbits.methods.smoothquant import ActQuantLinear
from fewbits.models.qlinear import QuantLinear
from fewbits.models.recipe import Recipe, Rule

Q = "model.layers.0.self_attn.q_proj"
RECIPES = {  # non-default parameters, so that a parameter lost on the way changes the logits
    "smoothquant": Recipe((Rule(".*", "int8", "smoothquant", {"alpha": 0.5, "act_bits": 6}),)),
    "llm-int8": Recipe((Rule(".*", "int8", "llm-int8", {"threshold": 2.5}),)),
}


def _saved(tiny, calib_ids, tmp_path, method: str):
    model = tiny("llama")
    recipe = RECIPES[method]
    api.quantize(model, recipe, calib_ids, progress=False)
    return model, api.save_quantized_model(model, recipe, tmp_path / method)


def _outlier_inputs(model, ids) -> int:
    """How many LLM.int8() layers of `model` see at least one outlier dimension on `ids`."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(outlier_dims(a[0], m.threshold).numel() > 0))
             for m in model.modules() if isinstance(m, Int8OutlierLinear)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return sum(seen)


def _edit_meta(out, change) -> None:
    mf = out / "fewbits.json"
    meta = json.loads(mf.read_text())
    change(meta)
    mf.write_text(json.dumps(meta))
    (out / "fewbits-manifest.json").unlink(missing_ok=True)  # the field checks, not the checksum, under test


@pytest.mark.parametrize("method", ["smoothquant", "llm-int8"])
def test_w8a8_models_reload_with_identical_logits(tiny, calib_ids, eval_ids, tmp_path, method: str) -> None:
    model, out = _saved(tiny, calib_ids, tmp_path, method)
    again, _, meta = api.load_quantized_model(out)
    assert meta["version"] == api.SAVED_VERSION == 2
    desc = meta["layers"][Q]
    if method == "smoothquant":
        assert desc["kind"] == "act_quant" and desc["act_bits"] == 6
        assert desc["children"]["inner"]["kind"] == "quant_linear"
        assert desc["children"]["inner"]["qweight"]["format"]["spec"] == "int8"
        layer = again.get_submodule(Q)
        assert type(layer) is ActQuantLinear and layer.act_bits == 6 and type(layer.inner) is QuantLinear
    else:
        assert desc == {"kind": "int8_outlier", "outlier_threshold": 2.5, "shape": [64, 64], "bias": False}
        layer = again.get_submodule(Q)
        assert type(layer) is Int8OutlierLinear and layer.threshold == 2.5 and layer.w_codes.dtype == torch.int8
        assert _outlier_inputs(again, eval_ids) > 0  # the 16-bit split is exercised on these inputs
    assert len(meta["layers"]) == 14  # 7 linears x 2 blocks; lm_head too (untied tiny llama)
    with torch.no_grad():
        assert torch.equal(again(eval_ids).logits, model(eval_ids).logits)


def test_unknown_layer_kind_names_the_layer(tiny, calib_ids, tmp_path) -> None:
    _, out = _saved(tiny, calib_ids, tmp_path, "smoothquant")
    _edit_meta(out, lambda m: m["layers"][Q].update(kind="act_quant_v9"))
    with pytest.raises(api.SavedModelError, match=rf"layer {Q}: unknown layer kind 'act_quant_v9'"):
        api.load_quantized_model(out)
    _edit_meta(out, lambda m: m["layers"][Q].update(kind="act_quant", children={"inner": {"kind": None}}))
    with pytest.raises(api.SavedModelError, match=rf"layer {Q}\.inner: unknown layer kind None"):
        api.load_quantized_model(out)


def test_broken_descriptions_are_clear_errors(tiny, calib_ids, tmp_path) -> None:
    _, out = _saved(tiny, calib_ids, tmp_path, "llm-int8")
    _edit_meta(out, lambda m: m["layers"][Q].pop("outlier_threshold"))
    with pytest.raises(api.SavedModelError, match=rf"layer {Q} \(int8_outlier\): outlier_threshold"):
        api.load_quantized_model(out)
    _edit_meta(out, lambda m: m["layers"][Q].update(outlier_threshold=6.0, shape=[64, 32]))
    with pytest.raises(api.SavedModelError, match=rf"{Q}: saved codes have shape \(64, 64\)"):
        api.load_quantized_model(out)
    _edit_meta(out, lambda m: m.update(version=3))
    with pytest.raises(api.SavedModelError, match="version 3 is not 'fewbits-quantized-model' version 1 or 2"):
        api.load_quantized_model(out)


def test_version_1_files_still_load(tiny, eval_ids, tmp_path) -> None:
    """A file as the first writer made it: "quantized_layers" maps each QuantLinear to its weight metadata."""
    model = tiny("llama")
    recipe = Recipe.from_format("int4-g32")
    api.quantize(model, recipe, progress=False)
    out = api.save_quantized_model(model, recipe, tmp_path / "q")

    def to_v1(meta: dict) -> None:
        meta["version"] = 1
        meta["quantized_layers"] = {n: d["qweight"] for n, d in meta.pop("layers").items()}

    _edit_meta(out, to_v1)
    again, _, meta = api.load_quantized_model(out)
    assert meta["layers"][Q] == {"kind": "quant_linear", "qweight": model.get_submodule(Q).qweight_meta}
    with torch.no_grad():
        assert torch.equal(again(eval_ids).logits, model(eval_ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["smoothquant", "llm-int8"])
def test_real_model_round_trip(smollm2, tmp_path, method: str) -> None:
    """SmolLM2-135M with its first two blocks in W8A8 (SmoothQuant on 4 x 64 calibration tokens) or
    LLM.int8(): saved with its tokenizer, reloaded, the same logits bit for bit."""
    from fewbits.data.texts import load_texts
    from fewbits.data.tokens import token_windows

    ref, tok = smollm2
    model = copy.deepcopy(ref)
    texts = load_texts("calib", max_chars=8_000)
    calib = torch.cat([token_windows(tok, t, 64, n_windows=2) for t in texts.values()])[:4]
    ids = token_windows(tok, load_texts("eval", max_chars=4_000)["prose"], 64, n_windows=1)
    opts = {"threshold": 6.0} if method == "llm-int8" else {"alpha": 0.5}
    recipe = Recipe((Rule(r"^model\.layers\.[01]\.", "int8", method, opts),))
    api.quantize(model, recipe, calib, progress=False)
    out = api.save_quantized_model(model, recipe, tmp_path / "q", tok)
    again, tok2, meta = api.load_quantized_model(out)
    kinds = {d["kind"] for d in meta["layers"].values()}
    assert len(meta["layers"]) == 14 and kinds == {"act_quant" if method == "smoothquant" else "int8_outlier"}
    assert tok2 is not None
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        assert torch.equal(again(input_ids=ids).logits, want)
    if method == "llm-int8":  # real activations cross the threshold 6: the outlier path is exercised
        assert _outlier_inputs(again, ids) > 0
