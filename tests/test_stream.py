"""Streamed quantisation (fewbits.stream) against the in-memory reference: `api.quantize` +
`api.save_quantized_model` on the same checkpoint must give the same tensors and metadata; and the
streamed run must hold far less than the model in memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fewbits import api
from fewbits.guard import QuantizeError
from fewbits.models.loading import ModelLoadError
from fewbits.models.recipe import Recipe, Rule

ROOT = Path(__file__).resolve().parents[1]


def write_sharded(d: Path, *, tie: bool = False, hidden: int = 64, inter: int = 128, layers: int = 3,
                  vocab: int = 256, heads: int = 4, shard: str = "60KB", seed: int = 0) -> Path:
    """A random Llama saved by transformers as bf16 shards with an index (several shards at these sizes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, tie_word_embeddings=tie,
                      max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size=shard)
    return d


def in_memory(src: Path, recipe: Recipe, out: Path, data: torch.Tensor | None = None) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    report = api.quantize(model, recipe, data=data, progress=False, chooser="reference")
    api.save_quantized_model(model, recipe, out, report=report, source=str(src))


def assert_same_output(a: Path, b: Path) -> None:
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ma, mb = (json.loads((d / "fewbits.json").read_text()) for d in (a, b))
    ra, rb = ma.pop("report"), mb.pop("report")
    assert ma == mb
    ra.pop("seconds"), rb.pop("seconds")
    assert ra == rb


@pytest.fixture
def calib() -> torch.Tensor:
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_streamed_equals_in_memory(tmp_path, calib, method, tie):
    src = write_sharded(tmp_path / "src", tie=tie)
    assert len(list(src.glob("*.safetensors"))) >= 3
    recipe = Recipe.from_format("int4-g32", method, lm_head="int8")
    data = calib if method == "gptq" else None
    report = api.quantize_streamed(src, recipe, tmp_path / "s", data=data, progress=False)
    in_memory(src, recipe, tmp_path / "m", data)
    assert_same_output(tmp_path / "s", tmp_path / "m")
    assert report.quantized_layers and all(r["bytes_after"] < r["bytes_before"] for r in report.quantized_layers)
    model, _, meta = api.load_quantized_model(tmp_path / "s", chooser="reference")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("method,fmt", [("awq", "int4-g32"), ("smoothquant", "int8"), ("hqq", "int4-g32"),
                                        ("llm-int8", "int8")])
def test_other_methods_stream_alike(tmp_path, calib, method, fmt):
    src = write_sharded(tmp_path / "src")
    recipe = Recipe.from_format(fmt, method)
    api.quantize_streamed(src, recipe, tmp_path / "s", data=calib, progress=False)
    in_memory(src, recipe, tmp_path / "m", calib)
    assert_same_output(tmp_path / "s", tmp_path / "m")


def test_gemma3_scaled_embedding_and_sliding_layers(tmp_path, calib):
    """Gemma 3 multiplies its embedding by sqrt(hidden) inside the embedding module and gives sliding and
    global layers different masks: the calibration capture with only the calibration tokens' rows in memory
    must give the same GPTQ codes."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
    transformers.Gemma3ForCausalLM(cfg).eval().save_pretrained(tmp_path / "src", max_shard_size="60KB")
    recipe = Recipe.from_format("int4-g32", "gptq")
    api.quantize_streamed(tmp_path / "src", recipe, tmp_path / "s", data=calib, progress=False)
    model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    report = api.quantize(model, recipe, data=calib, progress=False, chooser="reference")
    api.save_quantized_model(model, recipe, tmp_path / "m", report=report, source=str(tmp_path / "src"))
    assert_same_output(tmp_path / "s", tmp_path / "m")


def test_methods_before_and_after_the_calibrated_one(tmp_path, calib):
    """RTN listed before GPTQ quantises its layers before GPTQ calibrates (GPTQ sees them quantised), HQQ
    listed after quantises its layers after: the order `api.quantize` applies them in."""
    src = write_sharded(tmp_path / "src")
    recipe = Recipe(rules=(Rule(r"q_proj$", "int8", "rtn"), Rule(r"down_proj$", "int4-g32", "hqq"),
                           Rule(r"\.", "int4-g32", "gptq")))
    api.quantize_streamed(src, recipe, tmp_path / "s", data=calib, progress=False)
    in_memory(src, recipe, tmp_path / "m", calib)
    assert_same_output(tmp_path / "s", tmp_path / "m")


def test_blocks_after_the_last_planned_one_are_copied(tmp_path, calib):
    src = write_sharded(tmp_path / "src")
    recipe = Recipe(rules=(Rule(r"layers\.0\.", "int4-g32", "gptq"),))
    api.quantize_streamed(src, recipe, tmp_path / "s", data=calib, progress=False)
    in_memory(src, recipe, tmp_path / "m", calib)
    assert_same_output(tmp_path / "s", tmp_path / "m")


def test_refusals_leave_no_output(tmp_path, calib):
    src = write_sharded(tmp_path / "src")
    two = Recipe(rules=(Rule(r"q_proj$", "int4-g32", "awq"), Rule(r"\.", "int4-g32", "gptq")))
    with pytest.raises(QuantizeError, match="one calibrated method"):
        api.quantize_streamed(src, two, tmp_path / "o", data=calib, progress=False)
    with pytest.raises(QuantizeError, match="calibration"):
        api.quantize_streamed(src, Recipe.from_format("int4-g32", "gptq"), tmp_path / "o",
                              progress=False)
    # a NaN in the last block: found when that block is read, after two blocks were written
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.2.mlp.up_proj.weight"
    shard = src / index[name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(QuantizeError, match=r"model\.layers\.2\.mlp\.up_proj.*NaN"):
        api.quantize_streamed(src, "int4-g32", tmp_path / "o", progress=False)
    assert list(tmp_path.iterdir()) == [src]  # no output, no temporary left behind


def test_a_missing_tensor_is_named(tmp_path):
    src = write_sharded(tmp_path / "src")
    idx = src / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    del index["weight_map"]["model.norm.weight"]
    idx.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"no tensor model\.norm\.weight"):
        api.quantize_streamed(src, "int4-g32", tmp_path / "o", progress=False)


def test_model_bytes_and_the_automatic_choice(tmp_path, monkeypatch):
    import fewbits.stream as st

    src = write_sharded(tmp_path / "src")
    stored = sum(torch.Size(s).numel() * 2 for s in _shapes(src))  # bf16 on disk
    assert st.model_bytes_on_disk(src, "bf16") == stored
    assert st.model_bytes_on_disk(src, "fp32") == 2 * stored
    monkeypatch.setattr(st, "available_memory", lambda: 4 * stored)
    assert st.should_stream(src, "fp32") is False  # half of 4x is 2x: not more
    monkeypatch.setattr(st, "available_memory", lambda: 4 * stored - 1)
    assert st.should_stream(src, "fp32") is True and st.should_stream(src, "bf16") is False


# ---------------------------------------------------------------------- memory
_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from fewbits.stream import quantize_streamed
    warm, src, out = sys.argv[1:4]
    quantize_streamed(warm, "int4-g64", out + "-warm", progress=False)  # every lazy import, on a tiny model
    def status(key):
        line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:  # the peak so far forgotten (ru_maxrss even keeps the parent's)
        f.write("5")
    before = status("VmRSS")
    quantize_streamed(src, "int4-g64", out, progress=False)
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
""")


def test_streamed_memory_is_a_fraction_of_the_model(tmp_path):
    """10 blocks of ~16 MB each in float32 (~225 MB with embedding and head; 112 MB of bf16 shards):
    quantising them in a child process raises its peak resident memory by less than 40% of the model
    (about 20% measured: a block, its RTN temporaries, a 16 MB piece of the embedding); loading the model
    whole, as `api.quantize` needs, would raise it by at least 100%."""
    warm = write_sharded(tmp_path / "warm", layers=1)
    src = write_sharded(tmp_path / "src", hidden=512, inter=2048, layers=10, vocab=16384, heads=8, shard="30MB")
    model_bytes = sum(4 * torch.Size(e).numel() for e in _shapes(src))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(warm), str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = got["peak"] - got["before"]
    assert model_bytes > 200e6
    assert grew < 0.4 * model_bytes, f"peak RSS grew {grew / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model ({got})"
    in_memory(src, Recipe.from_format("int4-g64"), tmp_path / "m")
    assert_same_output(tmp_path / "out", tmp_path / "m")


def _shapes(src: Path) -> list[tuple[int, ...]]:
    from fewbits.models.lazy import CheckpointIndex

    return [e.shape for e in CheckpointIndex(src).entries.values()]


# ---------------------------------------------------------------------- torchrun
_WORKER = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    from fewbits.models.recipe import Recipe
    from fewbits.stream import quantize_streamed
    src, out = sys.argv[1:3]
    data = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    quantize_streamed(src, Recipe.from_format("int4-g32", "gptq"), out, data=data, progress=False)
""")


def test_two_processes_write_what_one_writes(tmp_path):
    """Under torchrun every rank streams the blocks and calibrates its share of the samples; rank 0 alone
    writes.  With two processes the output is bit for bit the one-process output (calib.runner's batches)."""
    import os
    import socket

    src = write_sharded(tmp_path / "src")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = {}
    for world in (1, 2):
        outs[world] = tmp_path / f"w{world}"
        procs = []
        for rank in range(world):
            env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
            if world > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(src), str(outs[world])], env=env,
                                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for p in procs:
            text, _ = p.communicate(timeout=300)
            assert p.returncode == 0, text[-3000:]
    assert_same_output(outs[1], outs[2])
