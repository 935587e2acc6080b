"""Checkpoints other tools write, read for evaluation: GGUF (through transformers / gguf-py), compressed-tensors
(through transformers / compressed-tensors), GPTQ and AWQ directories (built here bit by bit from the layouts
AutoGPTQ and AutoAWQ document, independently of fewbits' packing)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fewbits import api
from fewbits.models.external import AWQ_ORDER, CheckpointError, checkpoint_kind, dequantize_gptq

gguf = pytest.importorskip("gguf")


def _tiny(hidden: int = 256, inter: int = 512, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=272, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                          max_position_embeddings=128, bos_token_id=262, eos_token_id=263)
        return LlamaForCausalLM(cfg).eval()


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 262, (1, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return model(ids).logits


def _f16_dense(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2 and p.dtype == torch.float32:
                p.copy_(p.half().float())
    return m


def test_gguf_file_loads_to_fewbits_numbers(tmp_path):
    from fewbits.export.gguf import export_gguf
    from tests.export.test_gguf import _bpe_tokenizer

    m = _tiny()
    api.quantize(m, "q4_k", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    assert checkpoint_kind(path) == "gguf" and checkpoint_kind(tmp_path) == "gguf"
    model, tok, info = api.load_checkpoint(path)
    assert info["format"] == "Q4_K x14" and info["bits_per_weight"] == 4.5
    assert info["size_bytes"] == path.stat().st_size and tok is None
    assert torch.equal(_logits(model), _logits(_f16_dense(m)))


def test_compressed_tensors_directory(tmp_path):
    from fewbits.export import export_compressed_tensors

    m = _tiny(hidden=128, inter=192)
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    out = export_compressed_tensors(m, tmp_path / "ct")
    assert checkpoint_kind(out) == "compressed-tensors"
    model, _, info = api.load_checkpoint(out)
    assert "int4-g32" in info["format"]
    assert 4.5 <= info["bits_per_weight"] < 4.51  # int32 words of codes, fp16 scales per 32, the shapes
    assert torch.allclose(_logits(model), _logits(m), atol=1e-5)


def _write_packed_dir(tmp_path, model, tensors: dict, qc: dict):
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def _dense_rest(model, linears: set[str]) -> dict:
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in linears}


def _words_along(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (r, n) into int32 words along n, code j of a word in bits j*bits.. (2, 4, 8 bits)."""
    per = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, per)
    word = sum(c[..., j] << (bits * j) for j in range(per))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def test_gptq_word_layout_golden():
    """AutoGPTQ's 4-bit word 0x87654321 holds inputs 0..7 = 1..8 (first input in the lowest bits)."""
    qweight = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)  # (in / 8, out = 1)
    qzeros = torch.tensor([[0x00000007]], dtype=torch.int32)  # stored zero 7, used as 8
    w = dequantize_gptq(qweight, qzeros, torch.ones(1, 1, dtype=torch.float16), None, 4)
    assert w.tolist() == [[-7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0]]


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_directory(desc_act, tmp_path):
    m = _tiny(hidden=64, inter=128)
    g, bits = 32, 4
    gen = torch.Generator().manual_seed(0)
    tensors, want = {}, {}
    linears = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and "lm_head" not in n}
    for name in linears:
        out_f, in_f = m.get_submodule(name).weight.shape
        q = torch.randint(0, 16, (in_f, out_f), generator=gen)
        zeros = torch.randint(1, 16, (in_f // g, out_f), generator=gen)
        scales = (torch.rand(in_f // g, out_f, generator=gen) * 0.01).half()
        g_idx = torch.randperm(in_f, generator=gen) % (in_f // g) if desc_act else torch.arange(in_f) // g
        want[name] = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).T
        tensors[f"{name}.qweight"] = _words_along(q.T, bits).T  # (in / 8, out): packed along the input
        tensors[f"{name}.qzeros"] = _words_along(zeros - 1, bits)  # (groups, out / 8): zero - 1
        tensors[f"{name}.scales"] = scales
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    tensors.update(_dense_rest(m, linears))
    d = _write_packed_dir(tmp_path, m, tensors, {"quant_method": "gptq", "bits": 4, "group_size": g,
                                                 "desc_act": desc_act, "sym": False})
    model, _, info = api.load_checkpoint(d)
    assert info["kind"] == "gptq" and info["format"] == "gptq int4-g32-asym"
    for name, w in want.items():
        assert torch.equal(model.get_submodule(name).weight, w), name
    shapes = [m.get_submodule(n).weight.shape for n in linears]  # codes, zeros, fp16 scales, int32 g_idx
    nbytes = sum(o * i / 2 + (i // g) * o / 2 + (i // g) * o * 2 + 4 * i for o, i in shapes)
    assert info["bits_per_weight"] == pytest.approx(8 * nbytes / sum(o * i for o, i in shapes), rel=1e-12)


def test_awq_directory(tmp_path):
    m = _tiny(hidden=64, inter=128)
    g = 32
    gen = torch.Generator().manual_seed(1)
    tensors, want = {}, {}
    linears = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and "lm_head" not in n}

    def awq_pack(codes):  # (r, out) -> (r, out / 8): nibble k holds column AWQ_ORDER[k] of each 8
        c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
        word = sum(c[..., AWQ_ORDER[k]] << (4 * k) for k in range(8))
        return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    for name in linears:
        out_f, in_f = m.get_submodule(name).weight.shape
        q = torch.randint(0, 16, (in_f, out_f), generator=gen)
        zeros = torch.randint(0, 16, (in_f // g, out_f), generator=gen)
        scales = (torch.rand(in_f // g, out_f, generator=gen) * 0.01).half()
        gi = torch.arange(in_f) // g
        want[name] = ((q - zeros[gi]).float() * scales.float()[gi]).T
        tensors.update({f"{name}.qweight": awq_pack(q), f"{name}.qzeros": awq_pack(zeros), f"{name}.scales": scales})
    tensors.update(_dense_rest(m, linears))
    d = _write_packed_dir(tmp_path, m, tensors, {"quant_method": "awq", "bits": 4, "group_size": g,
                                                 "version": "gemm", "zero_point": True})
    model, _, info = api.load_checkpoint(d)
    for name, w in want.items():
        assert torch.equal(model.get_submodule(name).weight, w), name
    assert info["kind"] == "awq"


def test_unknown_paths_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such"):
        checkpoint_kind(tmp_path / "nothing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint_kind(tmp_path)
