"""q/k/v and gate/up as one matmul each (`fewbits.decode.fuse`): the fused step gives the unfused step's logits
and transformers' own greedy tokens, the parts read views of the fused tensors, and what does not fit the rule
(grouped fp8, W8A8, parts in different formats) stays apart with its reason."""

from __future__ import annotations

import pytest
import torch
from decode_models import build
from test_compiled import quantised

from fewbits.decode.fuse import fuse_group, fuse_projections
from fewbits.decode.runner import StaticDecoder, why_eager
from fewbits.generate import generate
from fewbits.kernels import prepare_linear
from fewbits.kernels.cpu_int4 import no_zeros
from fewbits.models.qlinear import QuantLinear
from fewbits.tensor import quantize_tensor

WEIGHTS = ["bf16", "int8", "int8-asym", "int4-g32", "fp8-e4m3"]
INT4_OPS = ("fewbits.int4pack_mm", "fewbits_q4.q4_mm")  # torch's int4 operator, fewbits' own


def model_in(family: str, weights: str) -> torch.nn.Module:
    model = build(family, torch.bfloat16)
    return model if weights == "bf16" else quantised(model, weights)


def teacher_forced(model: torch.nn.Module, ids: torch.Tensor, tokens: torch.Tensor, fuse: bool,
                   compile: bool = False, cache_dir=None) -> torch.Tensor:  # noqa: ANN001
    dec = StaticDecoder(model, "bf16", ids.shape[0], ids.shape[1] + tokens.shape[1], compile=compile, fuse=fuse,
                        cache_dir=cache_dir)
    out = [dec.prefill(ids)]
    for i in range(tokens.shape[1] - 1):
        out.append(dec.step(tokens[:, i]))
    return torch.stack(out, 1).float()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_fused_step_equals_unfused_and_eager(family: str, weights: str) -> None:
    """Every group fuses (Qwen2's q/k/v biases included; Qwen3/Gemma-3 norm q and k after the split); the
    fused step's logits equal the unfused step's (int8/int4: the same operator row by row, bitwise; bf16:
    one GEMM instead of several, to rounding), and its greedy tokens are transformers' own."""
    model = model_in(family, weights)
    ids = torch.randint(4, 320, (2, 9), generator=torch.Generator().manual_seed(7))
    ref = generate(model, ids, 16, kv="bf16").tokens  # transformers' forward, before any fusion
    unfused = teacher_forced(model, ids, ref, fuse=False)
    fused_dec = StaticDecoder(model, "bf16", 2, 9 + 16, compile=False)
    assert fused_dec.fused.skipped == []
    assert fused_dec.fused.matmuls_saved == 3 * len(model.model.layers)
    fused = teacher_forced(model, ids, ref, fuse=True)
    if weights == "bf16":
        torch.testing.assert_close(fused, unfused, rtol=0.02, atol=0.02)
    else:
        assert torch.equal(fused, unfused)
    assert torch.equal(fused.argmax(-1), ref)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_parts_read_views_of_the_fused_tensors(weights: str) -> None:
    """No second copy of the weights: each part's tensors lie inside the fused ones, its own forward gives
    its rows of the fused output (bitwise), and a second decoder over the model reuses the fused tensors."""
    model = model_in("qwen2", weights)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        before = [p(x) for p in parts]
        fused = fuse_projections(model, 2)
        f = fused.layers[0].qkv
        outs = f(x)
        after = [p(x) for p in parts]
    for b, o, a in zip(before, outs, after, strict=True):
        assert torch.equal(o, a)
        if weights == "bf16":
            torch.testing.assert_close(o, b, rtol=0.01, atol=0.01)
        else:
            assert torch.equal(o, b)
    held = {"dense": lambda o: o.weight, "int8": lambda o: o.kernel.q, "int4": lambda o: o.kernel.packed,
            "q4": lambda o: o.kernel.codes, "fp8": lambda o: o.kernel.w8}[f.kind]
    whole = held(f)
    for p in parts:
        t = held(p)
        assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        if f.kind == "q4":  # scales too; symmetric codes: the one shared empty zero-point tensor
            assert p.kernel.scales.untyped_storage().data_ptr() == f.kernel.scales.untyped_storage().data_ptr()
            assert f.kernel.zeros.numel() or p.kernel.zeros is f.kernel.zeros is no_zeros(f.kernel.scales.dtype)
        assert p.bias.untyped_storage().data_ptr() == f.bias.untyped_storage().data_ptr()
    assert fuse_projections(model, 2).layers[0].qkv is f
    if f.kind == "int4":  # the scale table too: each part reads its columns of the fused one
        assert all(p.kernel._table is f.kernel.scales_zeros for p in parts)  # the parts' own int4 scale tables


def _qlinear(w: torch.Tensor, spec: str) -> QuantLinear:
    return QuantLinear(quantize_tensor(w, spec), chooser=prepare_linear)


def test_what_does_not_fit_the_rule_stays_apart() -> None:
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(n, 128, generator=g) for n in (128, 64, 64)]
    cases = {
        "kernels differ": [_qlinear(w[0], "int8"), _qlinear(w[1], "int4-g32"), _qlinear(w[2], "int8")],
        "is not one that fuses": [_qlinear(t, "fp8-e4m3-g64") for t in w],
        "fp8 elements differ": [_qlinear(w[0], "fp8-e4m3"), _qlinear(w[1], "fp8-e5m2"), _qlinear(w[2], "fp8-e4m3")],
        "int4 groups differ": [_qlinear(w[0], "int4-g32"), _qlinear(w[1], "int4-g64"), _qlinear(w[2], "int4-g32")],
        "layer types differ": [torch.nn.Linear(128, 128), _qlinear(w[1], "int8"), _qlinear(w[2], "int8")],
    }
    for want, mods in cases.items():
        before = [m.kernel if hasattr(m, "kernel") else m.weight for m in mods]
        f, why = fuse_group(mods)
        assert f is None and want in why, why
        assert [m.kernel if hasattr(m, "kernel") else m.weight for m in mods] == before  # left untouched
    mods = [_qlinear(torch.randn(48, 128, generator=g), "int4-g32"), _qlinear(w[1], "int4-g32")]
    f, why = fuse_group(mods)
    if mods[0].kernel.name == "cpu_q4":  # blocks of 16 rows: 48 and 64 rows fuse
        assert why is None and f.kind == "q4" and f.kernel.codes.shape[0] == (48 + 64) // 16
    else:  # torch's operator packs 64 rows together
        assert f is None and "multiple of 64" in why


def test_compiled_fused_step_has_four_matmuls_a_layer_and_equal_logits(tmp_path) -> None:  # noqa: ANN001
    """The compiled graph holds 4 int4 matmuls a layer (7 unfused) plus the LM head's, and its logits equal
    the unfused compiled step's."""
    models = {fuse: quantised(build("llama", torch.bfloat16), "int4-g32", lm_head="int4-g32") for fuse in (0, 1)}
    if why_eager(models[0]) is not None:
        pytest.skip(why_eager(models[0]))
    ids = torch.randint(4, 320, (1, 10), generator=torch.Generator().manual_seed(5))
    ref = generate(models[0], ids, 8, kv="bf16").tokens
    counts = {}
    for fuse, model in models.items():  # a model each: fusing changes the parts' kernels
        dec = StaticDecoder(model, "bf16", 1, 20, compile=False, fuse=bool(fuse))
        dec.prefill(ids)
        with torch.no_grad():
            ex = torch._dynamo.explain(dec._decode)(ids[:, :1], dec.pos + 1, torch.tensor([10]))
        counts[fuse] = sum(str(n.target).startswith(INT4_OPS) for gr in ex.graphs
                           for n in gr.graph.nodes if n.op == "call_function")
    assert counts == {0: 7 * 2 + 1, 1: 4 * 2 + 1}
    runs = [teacher_forced(m, ids, ref, bool(fuse), compile=True, cache_dir=tmp_path) for fuse, m in models.items()]
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[1].argmax(-1), ref)


def test_a_model_decoded_with_fused_16bit_parts_still_saves(tmp_path) -> None:  # noqa: ANN001
    """The fused 16-bit q/k/v leave row views of one tensor in the model's layers; fewbits' own save and the
    compressed-tensors export copy them out (safetensors refuses tensors that share memory) and the saved
    model loads back with the same weights."""
    from safetensors import safe_open

    from fewbits.api import load_quantized_model, quantize, save_quantized_model
    from fewbits.export.compressed_tensors import export_compressed_tensors
    from fewbits.models.recipe import DEFAULT_IGNORE, Recipe

    model = build("llama", torch.bfloat16)
    recipe = Recipe.from_format("int8", ignore=(*DEFAULT_IGNORE, r".*\.self_attn\.[qkv]_proj"))
    quantize(model, recipe, progress=False, chooser=prepare_linear)
    StaticDecoder(model, "bf16", 1, 16, compile=False)  # fuses q/k/v (16-bit) and gate/up (int8)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().nbytes() > q.numel() * q.element_size()  # a view of the fused tensor
    save_quantized_model(model, recipe, tmp_path / "fewbits")
    export_compressed_tensors(model, tmp_path / "ct")
    back = load_quantized_model(tmp_path / "fewbits")[0]
    assert torch.equal(back.model.layers[0].self_attn.q_proj.weight, q)
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), q)


def test_q4_parts_with_and_without_zero_points_fuse_bitwise() -> None:
    """fewbits' int4 operator: a symmetric part (no zero offsets) fuses with asymmetric ones (its offsets become
    zeros) and the fused output is each part's own, bit for bit, at 1 and 8 rows."""
    g = torch.Generator().manual_seed(4)
    mods = [_qlinear(torch.randn(n, 128, generator=g), spec)
            for n, spec in ((64, "int4-g32"), (32, "int4-g32-asym"), (48, "int4-g32"))]
    if any(m.kernel.name != "cpu_q4" for m in mods):
        pytest.skip("fewbits' int4 operator does not run here")
    xs = [torch.randn(m, 128, generator=g).to(torch.bfloat16) for m in (1, 8)]
    with torch.no_grad():
        before = [[m(x) for m in mods] for x in xs]
        f, why = fuse_group(mods)
        assert why is None and f.kind == "q4" and f.kernel.zeros.shape == f.kernel.scales.shape
        for x, want in zip(xs, before, strict=True):
            for got, w, m in zip(f(x), want, mods, strict=True):
                assert torch.equal(got, w) and torch.equal(m(x), w)


def test_fp8_parts_per_tensor_and_per_channel_fuse_bitwise() -> None:
    """A per-tensor part's one scale is repeated for its rows: the fused matmul gives each part's own output."""
    g = torch.Generator().manual_seed(4)
    mods = [_qlinear(torch.randn(n, 128, generator=g), spec) for n, spec in ((96, "fp8-e4m3-t"), (32, "fp8-e4m3"))]
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        before = [m(x) for m in mods]
        f, why = fuse_group(mods)
        assert why is None and f.kind == "fp8" and f.kernel.channel_scales.shape == (128,)
        for b, o, a in zip(before, f(x), [m(x) for m in mods], strict=True):
            assert torch.equal(o, b) and torch.equal(a, b)
        many = torch.randn(12, 128, generator=g).to(torch.bfloat16)  # more rows: the bf16-decoding path
        assert torch.equal(torch.cat([m(many) for m in mods], -1), f.kernel(many))
