"""compressed-tensors checkpoints against the reference readers: the `compressed-tensors` package's own
decompressor (exact weights, every integer layout) and transformers' loader (the same logits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fewbits import api
from fewbits.export import ExportError, check_formats, export_compressed_tensors
from fewbits.models.qlinear import QuantLinear
from fewbits.models.recipe import Recipe, Rule

pytest.importorskip("compressed_tensors")


def make_tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                          max_position_embeddings=128)
        return LlamaForCausalLM(cfg).eval()


def _quantised(spec, tie: bool = False, **kw):
    m = make_tiny_llama(tie=tie)
    api.quantize(m, Recipe.from_format(spec, **kw) if kw else spec, progress=False, chooser="cached")
    return m


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("spec", ["int4-g32-asym", "int8-asym", "int2-g32-asym", "int3-g32-asym", "int4-g32",
                                  "int8", "int3-g32", "int4", "int4-g32-narrow", "int8-narrow"])
def test_reference_decompressor_gives_fewbits_weights_exactly(spec, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    m = _quantised(spec)
    out = export_compressed_tensors(m, tmp_path / "ct")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["ignore"] == ["lm_head"]
    sd = load_file(out / "model.safetensors")
    (group,) = cfg["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    n = 0
    for name, mod in m.named_modules():
        if isinstance(mod, QuantLinear):
            local = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
            local["weight_scale"] = local["weight_scale"].float()  # its arithmetic in fp32, as fewbits'
            w = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
            assert torch.equal(w.float(), mod.qweight.dequantize(torch.float32)), name
            if mod.qweight.fmt.sym_int and mod.qweight.fmt.grid == "full":  # the end code -2^(b-1), signed scales
                assert int(mod.qweight.unpacked_codes().min()) == 0 and bool((local["weight_scale"] < 0).any())
            n += 1
    assert n == 14


@pytest.mark.parametrize("spec", ["int4-g32", "int8", "int3-g32", "fp8-e4m3"])
def test_transformers_loads_the_same_model(spec, tmp_path):
    m = _quantised(spec)
    loaded = _load(export_compressed_tensors(m, tmp_path / "ct"))
    assert torch.equal(_logits(m), _logits(loaded))


def test_a_quantised_tied_head_is_untied(tmp_path):
    m = _quantised("int4-g32", tie=True, lm_head="int8")
    out = export_compressed_tensors(m, tmp_path / "ct")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["ignore"] == []
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    assert len(cfg["quantization_config"]["config_groups"]) == 2  # int4-g32 body, int8 head: named layers
    assert torch.equal(_logits(m), _logits(_load(out)))


def test_a_tied_16_bit_head_is_written_once(tmp_path):
    from safetensors.torch import load_file

    m = _quantised("int8", tie=True)
    out = export_compressed_tensors(m, tmp_path / "ct")
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert torch.equal(_logits(m), _logits(_load(out)))


def test_mixed_formats_are_named_per_layer(tmp_path):
    m = make_tiny_llama(tie=False)
    api.quantize(m, Recipe(rules=(Rule(r"down_proj$", "fp8-e4m3"), Rule(r"mlp\.", "int8"), Rule(r".*", "int4-g32"))),
                 progress=False, chooser="cached")
    out = export_compressed_tensors(m, tmp_path / "ct")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision"
    targets = {g["format"]: g["targets"] for g in cfg["config_groups"].values()}
    assert targets["float-quantized"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert torch.equal(_logits(m), _logits(_load(out)))


@pytest.mark.parametrize(("spec", "why"), [("nf4-g32", "integer formats"), ("int4-g32-asym-zfp16", "zero points"),
                                           ("mxfp4", "integer formats"), ("fp8-e4m3-g32", "per-channel")])
def test_unsupported_formats_are_refused_before_writing(spec, why, tmp_path):
    with pytest.raises(ExportError, match=why):
        check_formats([spec])
    m = _quantised(spec)
    with pytest.raises(ExportError, match=why):
        export_compressed_tensors(m, tmp_path / "ct")
    assert not any(tmp_path.iterdir())  # no output, no temporary directory left


def test_unquantised_model_and_existing_output_are_refused(tmp_path):
    with pytest.raises(ExportError, match="no quantised linear layers"):
        export_compressed_tensors(make_tiny_llama(), tmp_path / "ct")
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_compressed_tensors(_quantised("int8"), tmp_path / "ct")
    assert (tmp_path / "ct" / "keep.txt").read_text() == "x"


def test_cli_quantize_to_compressed_tensors(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fewbits.cli import main
    from fewbits.models import loading

    monkeypatch.setattr(loading, "load_model", lambda name, dtype="fp32": (make_tiny_llama(tie=False), None))
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--to", "compressed-tensors", "-o",
                                  str(tmp_path / "ct"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert torch.equal(_logits(_quantised("int4-g32")), _logits(_load(tmp_path / "ct")))
    # a format the layout has no form for is refused before any work, with nothing written
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "nf4-g32", "--to", "compressed-tensors", "-o",
                                  str(tmp_path / "nf4")])
    assert r.exit_code != 0 and "nf4-g32" in r.output and not (tmp_path / "nf4").exists()


@pytest.mark.parametrize("target", ["compressed-tensors", "gguf"])
def test_wrapper_layers_are_refused_by_name(target, tmp_path):
    from fewbits.export.gguf import export_gguf

    m = _quantised("int8", method="llm-int8")  # outlier-split layers: no plain weight to write
    with pytest.raises(ExportError, match="Int8OutlierLinear"):
        if target == "gguf":
            export_gguf(m, tmp_path / "m.gguf", tokenizer=None)
        else:
            export_compressed_tensors(m, tmp_path / "ct")
    assert not any(tmp_path.iterdir())
