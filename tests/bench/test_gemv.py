"""Weight sets timed as a step runs them: a set's calls made from one compiled graph (`compiled_calls`, the
sampler's `graphs`) compute what its Python calls compute, each window of the cycle over its copies on its own
weights, and sets of the same calls share one graph."""

from __future__ import annotations

import pytest
import torch

from fewbits.bench.gemv import build_step_set, compiled_calls
from fewbits.decode.pages import tensors_of
from fewbits.decode.runner import no_compiler

LAYER = (("q_proj", (64, 64)), ("k_proj", (32, 64)), ("v_proj", (32, 64)), ("o_proj", (64, 64)),
         ("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128)))


def _outputs_in_python(kernels, x_by_in):
    outs = []
    for k in kernels:
        o = k(x_by_in[k.shape[1]])
        outs.extend(o if isinstance(o, (list, tuple)) else [o])
    return outs


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4-g32"])
def test_a_compiled_pass_computes_the_python_calls_outputs(spec, tmp_path, monkeypatch):
    if no_compiler():
        pytest.skip(no_compiler())
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    ws = build_step_set(spec, LAYER, 0)
    xs = {64: torch.randn(2, 1, 64).bfloat16(), 128: torch.randn(2, 1, 128).bfloat16()}
    graphs: dict = {}
    run = compiled_calls(ws.kernels, xs, graphs)
    got, want = run(), _outputs_in_python(ws.kernels, xs)
    assert len(graphs) == 1 and len(got) >= len(want) == 7  # q, k, v as three outputs of their fused call
    for g, w in zip(got, want, strict=False):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("spec", ["bf16", "int4-g32"])
def test_the_compiled_sampler_cycles_windows_on_their_own_weights_with_one_graph(spec, tmp_path, monkeypatch):
    """Two copies of a layer, one layer's calls a sample: two windows, one graph; each window's outputs are its
    own copy's (the copies' weights differ after one is changed), and a new set of the same calls reuses it."""
    if no_compiler():
        pytest.skip(no_compiler())
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    ws = build_step_set(spec, LAYER, 1)
    ws = build_step_set(spec, LAYER, 2 * ws.nbytes)
    assert ws.copies == 2
    per = len(ws.shapes)
    with torch.no_grad():
        for t in tensors_of(ws.kernels[per:]):  # the second copy's weights, changed: its window must see them
            t.mul_(-3.0) if t.is_floating_point() else t.bitwise_not_()  # codes: every nibble flipped
    xs = {64: torch.randn(1, 1, 64).bfloat16(), 128: torch.randn(1, 1, 128).bfloat16()}
    graphs: dict = {}
    sample = ws.sampler(xs, per, graphs)
    assert len(graphs) == 1
    windows = [compiled_calls(ws.kernels[i * per:(i + 1) * per], xs, graphs) for i in range(2)]
    first, second = windows[0](), windows[1]()
    for got, kernels in ((first, ws.kernels[:per]), (second, ws.kernels[per:])):
        for g, w in zip(got, _outputs_in_python(kernels, xs), strict=False):
            assert torch.equal(g, w)
    assert not torch.equal(first[3], second[3])  # o_proj's output: the two copies' weights differ
    sample(), sample()  # the sampler's windows in turn, no error
    again = build_step_set(spec, LAYER, 0, seed=5)
    compiled_calls(again.kernels, xs, graphs)
    assert len(graphs) == 1  # the same calls: the same graph, called with the new set's tensors


def test_a_compiled_pass_is_saved_and_loaded_without_compiling_again(tmp_path, monkeypatch):
    """The next process (here: a new dict of graphs) loads the saved pass instead of tracing and compiling."""
    if no_compiler():
        pytest.skip(no_compiler())
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    ws = build_step_set("int8", LAYER, 0)
    xs = {64: torch.randn(1, 1, 64).bfloat16(), 128: torch.randn(1, 1, 128).bfloat16()}
    want = compiled_calls(ws.kernels, xs, {})()
    assert len(list((tmp_path / "inductor" / "fewbits-passes").glob("*.bin"))) == 1

    def no_compiling(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch, "compile", no_compiling)
    got = compiled_calls(ws.kernels, xs, {})()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_calls_key_follows_the_calls_structure_not_their_values():
    from fewbits.decode.precompiled import calls_key

    a, b = build_step_set("int8", LAYER, 0), build_step_set("int8", LAYER, 0, seed=7)
    assert calls_key(a.kernels, {}) == calls_key(b.kernels, {})  # other weights, the same calls
    assert calls_key(a.kernels, {}) != calls_key(a.kernels, {"inputs": 1})
    assert calls_key(a.kernels, {}) != calls_key(build_step_set("int4-g32", LAYER, 0).kernels, {})
    wider = (("q_proj", (64, 128)),) + LAYER[1:]
    assert calls_key(build_step_set("bf16", LAYER, 0).kernels, {}) != \
        calls_key(build_step_set("bf16", wider, 0).kernels, {})


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4-g32", "int4-g64"])
def test_every_copy_of_a_set_keys_as_the_first(spec):
    """A set's later copies are built as its first is (a quantised layer's kernel holding its own codes), so that
    the windows of a cycle over them key alike and share one compiled graph."""
    from fewbits.decode.precompiled import calls_key

    ws = build_step_set(spec, LAYER, 1)
    ws = build_step_set(spec, LAYER, 3 * ws.nbytes)
    per = len(ws.shapes)
    keys = {calls_key(ws.kernels[i * per:(i + 1) * per], {}) for i in range(ws.copies)}
    assert ws.copies == 3 and len(keys) == 1
    pairs = {calls_key(ws.kernels[i * per:(i + 2) * per], {}) for i in range(ws.copies - 1)}
    assert len(pairs) == 1  # windows of two copies too
