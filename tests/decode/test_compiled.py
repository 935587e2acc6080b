"""The compiled step: one graph without breaks (quantised matmuls as registered operators), the eager path's
greedy tokens, and the compile cache scoped to the call."""

from __future__ import annotations

import os

import pytest
import torch
from decode_models import build, teacher_forced_logits

from fewbits.decode.runner import StaticDecoder, compile_scope, why_eager
from fewbits.kernels import native, rows


def quantised(model: torch.nn.Module, fmt: str, lm_head: str | None = None) -> torch.nn.Module:
    from fewbits.api import quantize
    from fewbits.kernels import prepare_linear
    from fewbits.models.recipe import Recipe

    quantize(model, Recipe.from_format(fmt, misfit="regroup", lm_head=lm_head), progress=False, chooser=prepare_linear)
    return model


@pytest.fixture(scope="module")
def int4_llama() -> torch.nn.Module:
    return quantised(build("llama", torch.bfloat16), "int4-g32", lm_head="int8")


def test_step_is_one_graph_with_quantised_ops(int4_llama: torch.nn.Module) -> None:
    """torch._dynamo.explain over a decode step with int4 linears, an int8 LM head and an int4 KIVI cache."""
    dec = StaticDecoder(int4_llama, "int4-g8-r8", 1, 40, compile=False)
    dec.prefill(torch.randint(4, 320, (1, 12)))
    ids, slot = torch.tensor([[5]]), torch.tensor([12])
    with torch.no_grad():
        ex = torch._dynamo.explain(dec._decode)(ids, dec.pos + 1, slot)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    targets = {str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("fewbits.int4pack_mm" in t or "fewbits_q4.q4_mm" in t for t in targets), sorted(targets)[:20]
    int8_op = "fewbits_rows.int8_mm" if rows.enabled() else "fewbits.int8pack_mm"  # the int8 head's kernel class
    assert any(int8_op in t for t in targets), sorted(targets)[:20]
    if dec.cache[0].native_append:  # the KIVI cache's write: one operator per layer, no flush under torch.where
        n_layers = len(dec.cache)
        nodes = [str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert sum("append_kv" in t for t in nodes) == n_layers
        assert not any("where" in t for t in nodes)


@pytest.mark.parametrize("kv", ["bf16", "int8", "int4-g8-r8"])
def test_compiled_step_equals_uncompiled(int4_llama: torch.nn.Module, kv: str, tmp_path) -> None:
    """Teacher-forced with the eager path's greedy tokens, the compiled step's logits equal the uncompiled
    step's (whose tokens are the eager path's, test_static.py) to bf16 rounding: the compiled attention reads
    a quantised cache's codes with the scale folded in (fp32), the uncompiled one a bf16 copy.  (A random
    bf16 model's logits lie too close together for its greedy tokens to be a stable reference.)"""
    if why_eager(int4_llama) is not None:
        pytest.skip(why_eager(int4_llama))
    ids = torch.randint(4, 320, (1, 10), generator=torch.Generator().manual_seed(5))
    got, want = teacher_forced_logits(int4_llama, kv, ids, 12, tmp_path)
    torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.0)
    assert any(tmp_path.rglob("*")), "inductor wrote nothing to the scoped cache directory"
    if not native.shims_supported():
        return
    # the C++ wrapper calls fewbits' operators through their C shims (`native.c_shims`), not by name
    wrappers = [t for t in (p.read_text() for p in tmp_path.rglob("*.cpp")) if "inductor_entry_impl" in t]
    assert wrappers, "no C++ wrapper was written"
    assert 'aoti_torch_call_dispatcher("fewbits' not in "".join(wrappers)
    assert "aoti_torch_cpu_attend_" in "".join(wrappers)


@pytest.mark.parametrize("fmt", ["int4-g32", "int8-asym"])
def test_kernels_bound_to_the_placed_block_give_the_same_step_with_fewer_inputs(
        fmt: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The decoder binds its int4 and int8 kernels to the block its tensors were placed in
    (`fewbits.kernels.arena`): the compiled step takes that block once instead of each kernel's tensors, and
    computes the same logits, bit for bit, as the step over the tensors (``FEWBITS_BIND=0``)."""
    import copy

    from fewbits.decode import pages

    if why_eager(build("llama")) is not None:
        pytest.skip(why_eager(build("llama")))
    monkeypatch.setattr(pages, "HUGE", 4096)  # the tiny model's tensors fill less than one huge page
    model = quantised(build("llama", torch.bfloat16), fmt, lm_head=fmt)
    twin = copy.deepcopy(model)
    bound = StaticDecoder(model, "bf16", 1, 24, cache_dir=tmp_path)
    if bound.placement.why_not is not None:
        pytest.skip(bound.placement.why_not)
    monkeypatch.setenv("FEWBITS_BIND", "0")
    plain = StaticDecoder(twin, "bf16", 1, 24, cache_dir=tmp_path)
    assert bound.bound > 0 and plain.bound == 0
    assert bound.direct and plain.direct
    # 2 layers x (q/k/v, o, gate/up, down) + the head: 9 kernels, each two tensors fewer
    assert bound.graph_inputs <= plain.graph_inputs - 17, (bound.graph_inputs, plain.graph_inputs)
    ids = torch.randint(4, 320, (1, 10), generator=torch.Generator().manual_seed(6))
    a, b = bound.prefill(ids), plain.prefill(ids)
    assert torch.equal(a, b)
    for i in range(8):
        nxt = a.argmax(-1)
        a, b = bound.step(nxt), plain.step(nxt)
        assert torch.equal(a, b), i


def test_compile_scope_restores_the_environment(tmp_path) -> None:
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with compile_scope(tmp_path):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


def test_eager_reason_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEWBITS_EAGER", "1")
    assert why_eager(build("llama")) == "FEWBITS_EAGER=1"


def _cpp_code(fn, *args) -> str:  # noqa: ANN001 - the C++ inductor generates for fn, compiled afresh
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad(), compile_scope():
        _, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), *args)
    return code


def _reduction_bodies(fn, *args) -> list[str]:  # noqa: ANN001 - the reduction loops' bodies of fn's C++ code
    import re

    code = _cpp_code(fn, *args)
    return re.findall(r"tmp_acc\w*_vec = [^;]*;(.*?)vec_reduce_all", code, re.S)


def test_query_rotary_embedding_is_stored_once_not_recomputed_per_slot() -> None:
    """Inductor inlines a pointwise query into the score reduction over every cache slot, recomputing its
    cos/sin per slot (0.4 ms a layer on SmolLM2); `_stored` makes it write the query once.  The identity
    shows the check can see the recomputation."""
    from fewbits.decode.step import _rope, _signed_sin, _stored

    q, k = torch.randn(1, 3, 1, 64).to(torch.bfloat16), torch.randn(1, 3, 256, 64).to(torch.bfloat16)
    ang = torch.randn(1, 1, 1, 64)

    def scores(q, k, ang, keep=_stored):  # noqa: ANN001, ANN202
        qr = keep(_rope(q, ang.cos().to(q.dtype), _signed_sin(ang.sin().to(q.dtype))))
        return (qr.float() * k.float()).sum(-1)

    assert any(".cos()" in b for b in _reduction_bodies(lambda *a: scores(*a, keep=lambda x: x), q, k, ang))
    bodies = _reduction_bodies(scores, q, k, ang)
    assert bodies and not any(".cos()" in b for b in bodies)
    ref = (_rope(q, ang.cos().to(q.dtype), _signed_sin(ang.sin().to(q.dtype))).float() * k.float()).sum(-1)
    torch._dynamo.reset()
    with compile_scope():  # fused 16-bit arithmetic rounds as eager does: the same scores
        torch.testing.assert_close(torch.compile(scores, fullgraph=True)(q, k, ang), ref, atol=1e-5, rtol=1e-5)


def _bool_buffers_written(dec: StaticDecoder) -> int:
    """The bool buffers the compiled decode step's C++ kernels write, summed over their calls."""
    import re

    code = _cpp_code(dec._decode, torch.tensor([[5]]), dec.pos + 1, torch.tensor([12]))
    signatures = dict(re.findall(r"(cpp_fused\w+) = async_compile\.cpp_pybinding\((\[.*?\]), r'''", code, re.S))
    calls = re.findall(r"\n\s+(cpp_fused\w+)\(", code)
    assert calls, "no C++ kernel calls found in the generated code"
    return sum(signatures[c].count("'bool*'") for c in calls)


def test_attention_mask_is_stored_once_a_step_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor recomputed the step's mask (valid slots up to the query's) inside every layer's kernel, into
    that layer's operator buffer (batch 8, 2048 tokens: ~4% of a step); `_stored` writes it once.  Six
    layers: the valid slots and the mask written, against one mask a layer with the identity."""
    from fewbits.decode import step

    dec = StaticDecoder(build("llama", torch.bfloat16, layers=6), "bf16", 1, 40, compile=False)
    dec.prefill(torch.randint(4, 320, (1, 12)))
    assert _bool_buffers_written(dec) == 2
    monkeypatch.setattr(step, "_stored", lambda x: x)
    assert _bool_buffers_written(dec) == 1 + 6


def test_rope_equals_transformers_rotary_embedding() -> None:
    """`_rope` with the signed sine (a roll instead of rotate_half's cat) gives transformers' own
    `apply_rotary_pos_emb` bit for bit, in bf16 and fp32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fewbits.decode.step import _rope, _signed_sin

    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        q, k = torch.randn(2, 9, 3, 64, generator=g).to(dt), torch.randn(2, 3, 3, 64, generator=g).to(dt)
        ang = torch.randn(2, 3, 64, generator=g) * 10
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        rq, rk = apply_rotary_pos_emb(q, k, cos, sin)  # (unsqueezes cos / sin at dim 1)
        ssin = _signed_sin(sin.unsqueeze(1))
        assert torch.equal(_rope(q, cos.unsqueeze(1), ssin), rq)
        assert torch.equal(_rope(k, cos.unsqueeze(1), ssin), rk)
