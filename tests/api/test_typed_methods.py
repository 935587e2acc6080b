"""`api.quantize(model, spec, method=GPTQ(...), data=api.calibration_data(...))`: typed configs reach the
method's maths, method names keep working, and the report (and fewbits.json) records the configs and the
calibration used."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fewbits import api
from fewbits.models.recipe import Recipe, RecipeError, Rule

IDS = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(3))


def logits(m):
    with torch.inference_mode():
        return m(input_ids=IDS).logits


@pytest.fixture
def data(tiny_tokenizer):
    return api.calibration_data(tiny_tokenizer, samples=4, seq_len=64)


@pytest.mark.parametrize("config, other", [
    (api.GPTQ(act_order=False, damp=0.05), api.GPTQ()),
    (api.AWQ(clip=False, grid=5), api.AWQ()),
    (api.HQQ(iters=2), api.HQQ()),
    (api.SmoothQuant(smooth=False), api.SmoothQuant(alpha=0.8)),
])
def test_a_typed_config_is_the_same_as_the_named_method_with_options(tiny_llama, data, config, other):
    spec = "int8" if config.method == "smoothquant" else "int4-g32-asym" if config.method == "hqq" else "int4-g32"
    a, b, c = (copy.deepcopy(tiny_llama) for _ in range(3))
    rep = api.quantize(a, spec, method=config, data=data, progress=False, chooser="cached")
    api.quantize(b, Recipe((Rule(".*", spec, config.method, config.options()),)), data=data, progress=False,
                 chooser="cached")
    api.quantize(c, spec, method=other, data=data, progress=False, chooser="cached")
    assert torch.equal(logits(a), logits(b))  # the same options reach the runner either way
    assert not torch.equal(logits(a), logits(c))  # and they matter: other options give other weights
    assert rep.method_configs == [config.to_dict()]
    assert rep.recipe["rules"][0]["method"] == config.method


def test_method_names_still_work_and_default_to_rtn(tiny_llama, data):
    a, b = copy.deepcopy(tiny_llama), copy.deepcopy(tiny_llama)
    api.quantize(a, "int4-g32", method="gptq", data=data, progress=False, chooser="cached")
    api.quantize(b, "int4-g32", method=api.GPTQ(), data=data, progress=False, chooser="cached")
    assert torch.equal(logits(a), logits(b))
    rep = api.quantize(copy.deepcopy(tiny_llama), "int8", progress=False)
    assert rep.method_configs == [{"method": "rtn"}] and rep.calibration is None


def test_bad_method_arguments_fail_before_any_change(tiny_llama, data):
    ref = logits(tiny_llama)
    with pytest.raises(RecipeError, match="method= goes with a format spec"):
        api.quantize(tiny_llama, Recipe.from_format("int8"), method="gptq", data=data, progress=False)
    with pytest.raises(RecipeError, match="has no option 'damping'"):
        api.quantize(tiny_llama, Recipe((Rule(".*", "int8", "gptq", {"damping": 0.1}),)), data=data)
    with pytest.raises(ValueError, match="does not work with format nf4-g32"):
        api.quantize(tiny_llama, "nf4-g32", method=api.GPTQ(), data=data, progress=False)
    with pytest.raises(RecipeError, match="gptq needs calibration data"):
        api.quantize(tiny_llama, "int4-g32", method=api.GPTQ(), progress=False)
    assert torch.equal(logits(tiny_llama), ref)


def test_report_and_saved_model_record_the_calibration(tiny_llama, data, tmp_path):
    recipe = Recipe.from_format("int4-g32", api.GPTQ(damp=0.02))
    rep = api.quantize(tiny_llama, recipe, data=data, progress=False, chooser="reference")
    assert rep.calibration == data.describe()
    assert "calibration: packaged mix (verse, prose, code), 4 x 64 tokens" in rep.text()
    out = api.save_quantized_model(tiny_llama, recipe, tmp_path / "q", report=rep)
    meta = json.loads((out / "fewbits.json").read_text())
    cal = meta["report"]["calibration"]
    assert cal["source"] == "packaged mix" and (cal["samples"], cal["seq_len"]) == (4, 64)
    assert [t["name"] for t in cal["texts"]] == ["verse", "prose", "code"] and len(cal["texts"][0]["sha256"]) == 64
    assert meta["report"]["method_configs"][0] == {"method": "gptq", "damp": 0.02, "act_order": True,
                                                   "block_size": 128, "static_groups": False,
                                                   "expert_min_tokens": 1.0}
    assert Recipe.from_dict(meta["recipe"]) == recipe


def test_token_ids_given_directly_are_recorded_by_shape_and_hash(tiny_llama, data):
    import hashlib

    rep = api.quantize(tiny_llama, "int4-g32", method="gptq", data=data.ids, progress=False, chooser="reference")
    want = hashlib.sha256(data.ids.numpy().tobytes()).hexdigest()
    assert rep.calibration == {"source": "token ids given by the caller", "samples": 4, "seq_len": 64,
                               "sha256": want}


def test_a_plugged_in_method_takes_no_options_unless_its_entry_names_a_config(tiny_llama, monkeypatch):
    monkeypatch.setitem(api.METHODS, "plain", api.MethodEntry("fewbits.api:run_rtn"))
    with pytest.raises(RecipeError, match="method plain has no option 'x'; it takes no options"):
        Recipe((Rule(".*", "int8", "plain", {"x": 1}),))
    rep = api.quantize(tiny_llama, "nf4-g32", method="plain", progress=False, chooser="reference")
    assert rep.method_configs == [{"method": "plain"}]  # any format: a plugged-in method checks its own
    monkeypatch.setitem(api.METHODS, "tuned", api.MethodEntry("fewbits.api:run_rtn", config=api.HQQ))
    assert Rule(".*", "int8", "tuned", {"iters": 3}).options == {"iters": 3}
