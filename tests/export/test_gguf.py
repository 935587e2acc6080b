"""GGUF files against the reference readers: gguf-py's own dequantiser (exact weights), transformers' GGUF
loader (the same logits and token ids).  (llama.cpp itself is not in CI; see benchmarks/compare_llamacpp.py.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fewbits import api
from fewbits.export import ExportError
from fewbits.export.gguf import _permute_rows, export_gguf, gguf_type
from fewbits.formats.format import parse_format
from fewbits.models.qlinear import QuantLinear

gguf = pytest.importorskip("gguf")


def _bpe_tokenizer():
    """A byte-level BPE tokenizer of 262 tokens: 256 bytes, 4 merges, 2 specials (as SmolLM2's is built)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    return tok


def _tiny(seed: int = 0, tie: bool = False, hidden: int = 128, inter: int = 192):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=272, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                          max_position_embeddings=128, bos_token_id=262, eos_token_id=263)
        return LlamaForCausalLM(cfg).eval()


def _as_written(model):
    """`model` with its dense matrices (embedding, unquantised head) rounded to F16, as an fp32 model's are
    written: the model a reader of the file should reproduce."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2 and p.dtype == torch.float32:
                p.copy_(p.half().float())
    return m


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 262, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize(("spec", "kind"), [("int4-g32", "Q4_0"), ("int8-g32", "Q8_0"), ("int5-g32", "Q5_0"),
                                          ("int4-g32-narrow", "Q4_0"), ("int8-g32-narrow", "Q8_0"),
                                          ("q4_k", "Q4_K"), ("q5_k", "Q5_K"), ("q6_k", "Q6_K"), ("q4_1", "Q4_1"),
                                          ("q5_1", "Q5_1")])
def test_gguf_reader_dequantises_fewbits_weights_exactly(spec, kind, tmp_path):
    m = _tiny(hidden=256, inter=512)
    api.quantize(m, spec, progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    for name, gname, heads in [("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight", 4),
                               ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight", 2),
                               ("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight", None)]:
        t = tensors[gname]
        assert t.tensor_type.name == kind
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        want = layers[name].qweight.dequantize(torch.float32)
        if heads:  # llama.cpp's rotary row order
            want = want[_permute_rows(want.shape[0], heads)]
        assert torch.equal(got.reshape(want.shape), want), name
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"


@pytest.mark.parametrize(("spec", "kind"), [("int4-g32", "Q4_0"), ("int8-g32-narrow", "Q8_0")])
def test_rtn_export_is_the_gguf_quantiser_byte_for_byte(spec, kind, tmp_path):
    """fewbits' RTN on the grid of each type writes the bytes gguf-py's own quantiser writes from the float
    weights (llama.cpp's reference rounding): Q4_0 is the full grid, Q8_0 the narrow one."""
    m = _tiny()
    floats = {n: mod.weight.detach().clone() for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    api.quantize(m, spec, progress=False, chooser="cached")
    tensors = {t.name: t for t in gguf.GGUFReader(export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())).tensors}
    for name, gname, heads in [("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight", 4),
                               ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight", 2),
                               ("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight", None)]:
        w = floats[name]
        if heads:
            w = w[_permute_rows(w.shape[0], heads)]
        want = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, kind))
        assert np.array_equal(np.asarray(tensors[gname].data).reshape(want.shape), want), name


@pytest.mark.parametrize("spec", ["int4-g32", "int8-g32"])
@pytest.mark.parametrize("tie", [False, True])
def test_transformers_loads_the_same_model(spec, tie, tmp_path):
    m = _tiny(tie=tie)
    api.quantize(m, spec, progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in names) != tie  # a tied head is read from token_embd
    assert torch.equal(_logits(_as_written(m)), _logits(_load(path)))


def test_mixed_recipe_one_file(tmp_path):
    """One file, one GGUF type per tensor as the recipe chose it (K-quants, 32-weight types, a calibrated
    integer format), read back exactly by gguf-py and to the same logits by transformers."""
    from fewbits.models.recipe import Recipe, Rule

    m = _tiny(hidden=256, inter=512)
    recipe = Recipe(rules=(Rule(r"self_attn\.(q|k)_proj", "q4_k"), Rule(r"self_attn", "q6_k"),
                           Rule(r"down_proj", "int5-g32", "gptq"), Rule(r"layers\.0\.", "q5_k"),
                           Rule(r".", "int4-g32")))
    data = torch.randint(0, 262, (4, 32), generator=torch.Generator().manual_seed(2))
    api.quantize(m, recipe, data=data, progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "Q5_0" and types["blk.0.ffn_up.weight"] == "Q5_K"
    down = {t.name: t for t in reader.tensors}["blk.1.ffn_down.weight"]  # GPTQ's codes, not rounded again
    got = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type))
    assert torch.equal(got.reshape(256, 512), m.model.layers[1].mlp.down_proj.qweight.dequantize())
    assert types["blk.1.ffn_gate.weight"] == "Q4_0" and types["token_embd.weight"] == "F16"
    assert torch.equal(_logits(_as_written(m)), _logits(_load(path)))


def test_fp32_model_is_written_in_16_bits(tmp_path):
    """An fp32 model's tied embedding goes in as F16 (never F32): half the bytes, the values F16 holds."""
    m = _tiny(tie=True)
    api.quantize(m, "int8-g32", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    t = {t.name: t for t in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    assert t.tensor_type.name == "F16"
    assert torch.equal(torch.from_numpy(np.array(t.data)).float(), m.model.embed_tokens.weight.half().float())
    with torch.no_grad():
        m.model.embed_tokens.weight[0, 0] = 1e5  # beyond F16: BF16 keeps the range
    path = export_gguf(m, tmp_path / "m2.gguf", _bpe_tokenizer())
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}["token_embd.weight"] == "BF16"


def test_bf16_model_and_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    m = _tiny().to(torch.bfloat16)
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    tok = _bpe_tokenizer()
    path = export_gguf(m, tmp_path / "m.gguf", tok, pre="default")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "BF16" and types["output_norm.weight"] == "F32"
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    text = "the thin cat in the tent"
    assert back(text).input_ids == tok(text).input_ids
    loaded = _load(path)
    assert torch.allclose(_logits(m.float()), _logits(loaded), atol=1e-4)


@pytest.mark.parametrize(("spec", "why"), [("int4-g64", "int4-g32"), ("int4-g32-asym", "q4_1"),
                                           ("int4-g32-asym-zfp16", "fp16 number"), ("nf4-g32", "Q4_0"),
                                           ("int8", "Q8_0"), ("int4-g32-sbf16", "fp16")])
def test_formats_without_an_exact_gguf_type_are_refused(spec, why, tmp_path):
    with pytest.raises(ExportError, match=why):
        gguf_type(parse_format(spec))
    m = _tiny()
    api.quantize(m, spec, progress=False, chooser="cached")
    with pytest.raises(ExportError):
        export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_with_biases(tie, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(Qwen2Config(vocab_size=272, hidden_size=128, intermediate_size=192,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=tie, max_position_embeddings=128)).eval()
        for layer in m.model.layers:  # biases worth checking (initialised to zero)
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.data.normal_()
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.bias"] == "F32" and types["blk.1.attn_v.weight"] == "Q4_0"
    assert torch.equal(_logits(_as_written(m)), _logits(_load(path)))


def test_mistral_is_written_as_llama(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = MistralForCausalLM(MistralConfig(vocab_size=272, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, sliding_window=None)).eval()
    api.quantize(m, "q4_k", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    field = gguf.GGUFReader(path).fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    assert torch.equal(_logits(_as_written(m)), _logits(_load(path)))


def test_gemma3_norms_shifted_and_logits_kept(tmp_path):
    """Gemma's RMSNorm multiplies by 1 + w; GGUF stores 1 + w (llama.cpp multiplies by the weight).  Norm
    weights are multiples of 2^-8 so that 1 + w - 1 is exact and transformers' reader gives the same logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = Gemma3TextConfig(vocab_size=272, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                               max_position_embeddings=128, sliding_window=8)
        m = Gemma3ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.copy_(torch.round(torch.randn_like(p) * 32) / 256)
    api.quantize(m, "q6_k", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    reader = gguf.GGUFReader(path)
    t = {t.name: t for t in reader.tensors}
    assert t["blk.0.attn_q_norm.weight"].tensor_type.name == "F32"
    want = m.model.layers[0].post_feedforward_layernorm.weight + 1
    assert torch.equal(torch.from_numpy(np.array(t["blk.0.post_ffw_norm.weight"].data)), want)
    assert int(reader.fields["gemma3.attention.sliding_window"].contents()) == 8
    loaded = _load(path)
    assert torch.equal(_logits(_as_written(m)), _logits(loaded))


def test_other_architectures_are_refused(tmp_path):
    from transformers import PhiConfig, PhiForCausalLM

    m = PhiForCausalLM(PhiConfig(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=4)).eval()
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    with pytest.raises(ExportError, match="phi"):
        export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    assert not any(tmp_path.iterdir())


def test_a_bias_the_architecture_has_no_name_for_is_refused(tmp_path):
    m = _tiny()
    m.model.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.ones(192))
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    with pytest.raises(ExportError, match="up_proj.bias"):
        export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    assert not any(tmp_path.iterdir())


def test_packaged_smollm2_round_trip(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from fewbits.models.packaged import gguf_tokenizer_pre

    model, tok = smollm2
    m = copy.deepcopy(model)
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "smol.gguf", tok, pre=gguf_tokenizer_pre("smollm2-135m"))
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "smollm"
    text = "Hello world! fewbits writes GGUF: 3.14159, déjà vu.\n  def f(x): return x**2"
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file="smol.gguf")(text).input_ids == tok(text).input_ids
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        assert torch.equal(_as_written(m)(ids).logits, _load(path)(ids).logits)


@pytest.mark.parametrize(("spec", "kind"), [("q8_0", "Q8_0"), ("q6_k", "Q6_K")])
def test_embedding_in_a_block_type(spec, kind, tmp_path):
    """--embedding: token_embd (read by a tied head too) in llama.cpp's own type, holding exactly what
    fewbits' RTN of the embedding gives; the rest of the file is as without it, and the file is smaller."""
    from fewbits.tensor import quantize_tensor

    m = _tiny(tie=True, hidden=256, inter=512)
    api.quantize(m, "int4-g32", progress=False, chooser="cached")
    plain = export_gguf(m, tmp_path / "plain.gguf", _bpe_tokenizer())
    path = export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer(), embedding=spec)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors["token_embd.weight"]
    assert t.tensor_type.name == kind and "output.weight" not in tensors
    got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    emb = m.get_input_embeddings().weight.detach().float()
    want = quantize_tensor(emb, spec).dequantize(torch.float32)
    assert torch.equal(got.reshape(want.shape), want) and not torch.equal(want, emb)
    before = {t.name: t for t in gguf.GGUFReader(plain).tensors}
    assert before["token_embd.weight"].tensor_type.name in ("F16", "BF16")
    for name in ("blk.0.ffn_down.weight", "blk.1.attn_q.weight"):
        assert np.array_equal(tensors[name].data, before[name].data)
    assert path.stat().st_size < plain.stat().st_size


def test_embedding_type_refused_before_writing(tmp_path):
    m = _tiny()
    with pytest.raises(ExportError, match="int4-g64"):
        export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer(), embedding="int4-g64")
    assert not (tmp_path / "m.gguf").exists()
