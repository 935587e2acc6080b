"""A saved model that is damaged or altered is refused on load, by name (issue 20, defects 6 and 8): the
manifest's sha256 first; without a manifest (a folder saved before manifests, or one whose manifest was
rewritten), the tensors themselves: NaN/inf scales, a NaN norm weight, a relabelled scale dtype, and every
field of fewbits.json the loader uses."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from click.testing import CliRunner

from fewbits import api
from fewbits.models.recipe import Recipe


@pytest.fixture
def saved(tiny, tmp_path):
    recipe = Recipe.from_format("int4-g32")
    api.quantize(tiny, recipe, progress=False)
    return api.save_quantized_model(tiny, recipe, tmp_path / "q", source="tiny")


def _rewrite_tensors(out, change) -> None:
    """Load model.safetensors, change it, save it again (keeping the fewbits metadata); drop the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    wf = out / "model.safetensors"
    with safe_open(str(wf), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    change(t)
    save_file(t, str(wf), metadata=meta)
    (out / "fewbits-manifest.json").unlink(missing_ok=True)


def _refused(out, match: str) -> str:
    with pytest.raises(api.SavedModelError, match=match) as e:
        api.load_quantized_model(out)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_bit_flip_is_refused_by_the_manifest(saved):
    wf = saved / "model.safetensors"
    data = bytearray(wf.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit in the middle of the weights
    wf.write_bytes(bytes(data))
    _refused(saved, "model.safetensors: sha256 differs")


def test_an_edited_metadata_file_is_refused_by_the_manifest(saved):
    meta = json.loads((saved / "fewbits.json").read_text())
    meta["source"] = "something else"
    (saved / "fewbits.json").write_text(json.dumps(meta))
    _refused(saved, "fewbits.json: .*manifest")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_scales_name_the_tensor(saved, value):
    name = "model.layers.1.self_attn.v_proj.qweight_scales"

    def change(t):
        t[name][0, 0] = value
    _rewrite_tensors(saved, change)
    assert "v_proj" in _refused(saved, "v_proj.*NaN or inf")


def test_a_nan_norm_weight_names_the_tensor(saved):
    def change(t):
        t["model.norm.weight"][3] = float("nan")
    _rewrite_tensors(saved, change)
    _refused(saved, "model.norm.weight holds NaN or inf")


def test_a_scale_dtype_relabelled_in_the_header_is_refused(saved):
    """F16 bytes read as BF16 give wrong but finite numbers: only the format's dtype can tell."""
    wf = saved / "model.safetensors"
    raw = wf.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = "model.layers.0.mlp.down_proj.qweight_scales"
    assert header[name]["dtype"] == "F16"
    header[name]["dtype"] = "BF16"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    wf.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    _refused(saved, "model.safetensors: .*manifest")
    (saved / "fewbits-manifest.json").unlink()
    _refused(saved, "down_proj.*scales stored as torch.bfloat16, format int4-g32 stores fp16")


def _edit_meta(out, change) -> None:
    meta = json.loads((out / "fewbits.json").read_text())
    change(meta)
    (out / "fewbits.json").write_text(json.dumps(meta))
    (out / "fewbits-manifest.json").unlink(missing_ok=True)


def _layer(meta):
    return meta["layers"]["model.layers.0.self_attn.q_proj"]


@pytest.mark.parametrize("change, match", [
    (lambda m: m.pop("model_class"), "model_class"),
    (lambda m: m.pop("dtype"), "\"dtype\" must be one of"),
    (lambda m: m.update(dtype="int8"), "\"dtype\" must be one of"),
    (lambda m: m.update(model_class="BertModel"), "BertModel"),  # config.json names no class
    (lambda m: m.update(model_class="os.system"), "model_class"),
    (lambda m: m.update(model_class="AutoConfig"), "not a transformers model class"),
    (lambda m: m.update(tied={"lm_head.weight": "model.nothing.weight"}), "ties 'lm_head.weight' to"),
    (lambda m: m.update(tied=["lm_head.weight"]), "\"tied\" must map"),
    (lambda m: _layer(m)["qweight"].update(format="int4-g32"), "q_proj.*malformed|q_proj"),
    (lambda m: m["layers"].update({"model.layers.0.self_attn.q_proj": "int4"}), "q_proj.*not an object"),
    (lambda m: m["layers"].update({"model.nowhere": {"kind": "quant_linear"}}), "model.nowhere"),
    (lambda m: m.update(recipe="int4"), "\"recipe\" has the wrong type"),
])
def test_malformed_metadata_fields_are_one_line_errors(saved, change, match):
    _edit_meta(saved, change)
    _refused(saved, match)


def test_deeply_nested_or_binary_metadata_is_one_line_error(saved):
    (saved / "fewbits.json").write_text("[" * 200_000 + "]" * 200_000)
    _refused(saved, "corrupt metadata")
    (saved / "fewbits.json").write_bytes(b"\xff\xfe\x00binary")
    _refused(saved, "corrupt metadata")


def test_eval_refuses_a_damaged_model_without_a_traceback(saved):
    from fewbits.cli import main

    wf = saved / "model.safetensors"
    data = bytearray(wf.read_bytes())
    data[-5] ^= 0x01
    wf.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["eval", str(saved), "--ref", "tiny-ref-not-needed"])
    assert r.exit_code == 1 and "sha256 differs" in r.output and "Traceback" not in r.output, r.output
    assert r.output.count("\n") == 1


def test_a_model_saved_before_manifests_still_loads(saved, tiny):
    (saved / "fewbits-manifest.json").unlink(missing_ok=True)
    model, _, _ = api.load_quantized_model(saved, chooser="cached")
    api.use_kernels(tiny, "cached")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny(ids).logits)
