"""GPTQ into llama.cpp's block types (q4_0 ... q8_0, q4_k, q5_k, q6_k): against round-to-nearest (llama.cpp's
reference quantiser, byte-exact in tests/formats/test_ggml.py) on the GPTQ objective, the limit where GPTQ must
be that quantiser, and the GGUF file gguf-py reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits import api
from fewbits.formats import ggml
from fewbits.formats.format import FormatError
from fewbits.methods.backend import ENV
from fewbits.methods.common import MethodError
from fewbits.methods.gptq import gptq_quantize
from fewbits.methods.rtn import rtn_quantize

BLOCK_TYPES = ["q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]


def _layer(rows: int = 64, cols: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and the Hessian X^T X of correlated inputs whose features differ in scale (as activations do)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(cols) + 2 * torch.randn(cols, cols, generator=g) / cols**0.5
    x = (torch.randn(2048, cols, generator=g) @ mix) * (torch.rand(cols, generator=g) * 3 + 0.2)
    return torch.randn(rows, cols, generator=g) * 0.02, x.T @ x


def _objective(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(dW H dW^T): the summed squared error of the layer's outputs on the calibration inputs."""
    d = (w_hat - w).double()
    return float(torch.trace(d @ h.double() @ d.T))


@pytest.mark.parametrize("spec", BLOCK_TYPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_llama_cpps_rounding_on_the_output_error(spec, act_order):
    """On correlated inputs GPTQ's output error is well below RTN's (llama.cpp's own quantiser), with block
    headers taken on the fly (natural order) or from the original weights (act-order)."""
    w, h = _layer()
    rtn = _objective(w, rtn_quantize(w, spec).dequantize(), h)
    res = gptq_quantize(w, h, spec, act_order=act_order)
    assert res.codes.dtype == torch.uint8 and res.zero is None
    assert res.scale.shape == rtn_quantize(w, spec).scale.shape  # one header per block, as RTN's
    assert _objective(w, res.dequantize(), h) < 0.75 * rtn


@pytest.mark.parametrize("spec", ["q4_k", "q5_k", "q6_k", "q4_0", "q5_1"])
def test_uncorrelated_inputs_give_llama_cpps_quantiser(spec):
    """With a diagonal Hessian no column's error moves another, so GPTQ in natural order must be llama.cpp's
    round-to-nearest: the same header bytes, the same values, the same codes wherever a code is not arbitrary
    (a zero sub-block scale) and not a 32-weight type's near-tie (its reference rounds with the unrounded d)."""
    w, _ = _layer(16, 512, seed=3)
    h = torch.diag(torch.rand(512, generator=torch.Generator().manual_seed(4)) + 0.5)
    ref = rtn_quantize(w, spec)
    res = gptq_quantize(w, h, spec, act_order=False)
    assert torch.equal(res.scale, ref.scale)
    s, _ = ggml.column_grid(ref.scale.to(torch.uint8), res.fmt, 512)
    live = s != 0
    same = float((res.codes == ref.codes)[live].float().mean())
    if spec.endswith("_k"):
        assert same == 1.0
        assert torch.equal(res.dequantize(), ref.dequantize())
    else:
        assert same > 0.99
        assert (res.dequantize() - w).abs().le((ref.dequantize() - w).abs()).all()  # the nearest on its grid


def test_formats_gptq_cannot_take_and_misfits_get_clear_errors(monkeypatch):
    w, h = _layer(8, 512)
    with pytest.raises(MethodError, match="gptq.*mxfp4"):
        gptq_quantize(w, h, "mxfp4")
    with pytest.raises(FormatError, match="576.*group size 256 of format q4_k"):
        gptq_quantize(torch.zeros(8, 576), torch.eye(576), "q4_k", name="mlp.up_proj")
    with pytest.raises(MethodError, match="numba column loop.*q4_k"):
        gptq_quantize(w, h, "q4_k", backend="numba")
    monkeypatch.setenv(ENV, "numba")
    with pytest.raises(MethodError, match=f"{ENV}.*q6_k"):
        gptq_quantize(w, h, "q6_k")
    assert gptq_quantize(w, h, "int4-g64").info["method"] == "gptq"  # integer formats still take numba
    monkeypatch.setenv(ENV, "auto")
    assert gptq_quantize(w, h, "q6_k").fmt.spec == "q6_k"  # auto: the torch loop


def _tokenizer():
    """A byte-level BPE tokenizer of 258 tokens (256 bytes, 2 specials): all the GGUF writer needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("spec", ["q4_k", "q6_k", "q5_0"])
def test_calibrated_blocks_reach_the_gguf_file_unrounded(spec, tmp_path):
    """api.quantize with GPTQ into a block type, exported: gguf-py's dequantiser reads back exactly the weights
    the fewbits model holds, and they are GPTQ's (not RTN's) codes."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fewbits.export.gguf import _permute_rows, export_gguf
    from fewbits.models.recipe import Recipe, Rule

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=264, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=256, eos_token_id=257)
    m = LlamaForCausalLM(cfg).eval()
    dense = {n: mod.weight.detach().clone() for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    data = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    api.quantize(m, Recipe(rules=(Rule(".", spec, "gptq"),)), data=data, progress=False, chooser="cached")
    path = export_gguf(m, tmp_path / "m.gguf", _tokenizer())
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    differs = 0
    for i in range(2):
        layer = m.model.layers[i]
        for gname, mod, key in ((f"blk.{i}.ffn_down.weight", layer.mlp.down_proj, "mlp.down_proj"),
                                (f"blk.{i}.attn_q.weight", layer.self_attn.q_proj, "self_attn.q_proj")):
            t = tensors[gname]
            assert t.tensor_type.name == spec.upper()
            got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
            want = mod.qweight.dequantize(torch.float32)
            if key.endswith("q_proj"):  # the writer permutes q's rows to llama.cpp's rotary layout
                want = want[_permute_rows(want.shape[0], 4)]
            assert torch.equal(got.reshape(want.shape), want), gname
            rtn = rtn_quantize(dense[f"model.layers.{i}.{key}"], spec).dequantize()
            differs += int((mod.qweight.dequantize(torch.float32) != rtn).any())
    assert differs == 4
