"""The CPU step saved on disk whole (`fewbits.decode.precompiled`): found again only for the same layout, loaded
without dynamo tracing, and reading the weights it is called with (none baked in)."""

from __future__ import annotations

import pytest
import torch
from decode_models import build

from fewbits.decode.precompiled import artifact_key
from fewbits.decode.runner import StaticDecoder, why_eager

PARTS = {"kv": "bf16", "batch": 1, "max_len": 64, "options": {"cpp_wrapper": True}}


def test_key_follows_layout_not_values() -> None:
    """Same shapes with other weight values: one key (the weights are inputs).  Another dtype, another family,
    another KV format, batch or cache length: another key."""
    a, b = build("llama"), build("llama")
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    assert artifact_key(a, PARTS) == artifact_key(b, PARTS)
    others = [artifact_key(build("llama", torch.bfloat16), PARTS), artifact_key(build("qwen2"), PARTS)]
    others += [artifact_key(a, {**PARTS, k: v}) for k, v in (("kv", "int8"), ("batch", 2), ("max_len", 128),
                                                               ("options", {"cpp_wrapper": False}))]
    assert len({artifact_key(a, PARTS), *others}) == len(others) + 1


def test_key_follows_quantised_format() -> None:
    from test_compiled import quantised

    assert artifact_key(quantised(build("llama", torch.bfloat16), "int4-g32"), PARTS) != \
        artifact_key(quantised(build("llama", torch.bfloat16), "int4-g64"), PARTS)


def test_unknown_wrapper_is_refused() -> None:
    with pytest.raises(ValueError, match="wrapper must be one of"):
        StaticDecoder(build("llama"), "bf16", 1, 16, wrapper="java")


def test_saved_step_loads_without_tracing_and_reads_the_given_weights(tmp_path) -> None:
    """A second decoder (another model object, other weight values, same layout) loads the saved step: dynamo
    traces no frame, and its logits are those of the uncompiled step on *its* weights."""
    from torch._dynamo.utils import counters

    first = build("llama", torch.bfloat16)
    if why_eager(first) is not None:
        pytest.skip(why_eager(first))
    StaticDecoder(first, "bf16", 1, 20, cache_dir=tmp_path)
    assert len(list((tmp_path / "fewbits-steps").glob("*.bin"))) == 1
    other = build("llama", torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    torch._dynamo.reset()
    frames = counters["frames"]["total"]
    dec = StaticDecoder(other, "bf16", 1, 20, cache_dir=tmp_path)
    assert counters["frames"]["total"] == frames, "the saved step was traced again"
    ref = StaticDecoder(other, "bf16", 1, 20, compile=False)
    ids = torch.randint(4, 320, (1, 6), generator=torch.Generator().manual_seed(1))
    got, want = [dec.prefill(ids)], [ref.prefill(ids)]
    for t in (7, 9, 11):
        got.append(dec.step(torch.tensor([t])))
        want.append(ref.step(torch.tensor([t])))
    got, want = torch.stack(got).float(), torch.stack(want).float()
    torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.0)


def test_a_step_with_bound_kernels_loads_in_a_fresh_model_after_another_cache(tmp_path, monkeypatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """int4 kernels bound to the placed weights' block (`fewbits.kernels.arena`) bake their offsets into the
    saved step; another model object of the same layout (its weights in another mapping, anywhere) and a decoder
    whose model another decoder with another cache placed first both load it without tracing or a refusal."""
    import logging

    from test_compiled import quantised
    from torch._dynamo.utils import counters

    from fewbits.decode import pages

    monkeypatch.setattr(pages, "HUGE", 64 << 10)  # the tiny model fills less than one huge page
    first = quantised(build("llama", torch.bfloat16), "int4-g32", lm_head="int4-g32")
    if why_eager(first) is not None:
        pytest.skip(why_eager(first))
    a = StaticDecoder(first, "bf16", 1, 20, cache_dir=tmp_path)  # places the weights, its cache apart
    if a.placement.why_not is not None:
        pytest.skip(a.placement.why_not)
    StaticDecoder(first, "bf16", 2, 40, cache_dir=tmp_path)  # the weights placed and bound already, by `a`
    assert a.bound > 0
    for batch, length in ((1, 20), (2, 40)):
        other = quantised(build("llama", torch.bfloat16), "int4-g32", lm_head="int4-g32")
        torch._dynamo.reset()
        frames = counters["frames"]["total"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fewbits.decode"):
            dec = StaticDecoder(other, "bf16", batch, length, cache_dir=tmp_path)
        assert not [r for r in caplog.records if "does not fit" in r.getMessage()], caplog.text
        assert counters["frames"]["total"] == frames, f"batch {batch}: the saved step was traced again"
        assert dec.bound == a.bound and dec.placement.address != a.placement.address



def test_decoders_on_the_model_pickle_empty() -> None:
    """The decoders a model holds (each with its compiled step) pickle as an empty dict: a later step's saved
    guards, which pickle the model's attributes, must not reach an earlier step's guard manager."""
    import pickle

    from fewbits.decode.generate import Decoders

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    held = Decoders({("bf16", 1, 64): Unpicklable()})
    assert pickle.loads(pickle.dumps(held)) == {} and len(held) == 1
    with pytest.raises(TypeError):
        pickle.dumps(dict(held))


def test_every_shape_of_one_model_is_saved(tmp_path, monkeypatch) -> None:
    """Two shapes decoded over one model in one process: both compiled steps are saved (the second used to fail
    to pickle its guards, which reached the first decoder held on the model, and was compiled afresh in every
    later process)."""
    from fewbits.decode.generate import generate_static

    model = build("llama", torch.bfloat16)
    if why_eager(model) is not None:
        pytest.skip(why_eager(model))
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    ids = torch.randint(4, 320, (1, 6), generator=torch.Generator().manual_seed(1))
    for batch in (1, 2):
        assert generate_static(model, ids.expand(batch, -1).contiguous(), 2).path == "compiled"
    assert len(list((tmp_path / "inductor" / "fewbits-steps").glob("*.bin"))) == 2


def test_step_sees_weights_changed_in_place(tmp_path) -> None:
    """The compiled step checks dynamo's guards on its first call only; later calls still read the weights where
    they are: values changed in place between steps reach the logits, as on the uncompiled step."""
    model = build("llama", torch.bfloat16)
    if why_eager(model) is not None:
        pytest.skip(why_eager(model))
    dec = StaticDecoder(model, "bf16", 1, 20, cache_dir=tmp_path)
    ref = StaticDecoder(model, "bf16", 1, 20, compile=False)
    ids = torch.randint(4, 320, (1, 6), generator=torch.Generator().manual_seed(2))
    dec.prefill(ids), ref.prefill(ids)
    before = dec.step(torch.tensor([7])).float()
    ref.step(torch.tensor([7]))
    with torch.no_grad():
        model.model.norm.weight.mul_(-2.0)
    tok = torch.tensor([[9, 3]])[:, 0]  # a strided view: the step copies it into its own input
    got, want = dec.step(tok).float(), ref.step(tok).float()
    torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.0)
    assert float((got - before).abs().max()) > 0.5 * float(before.abs().max())


def test_step_calls_its_graph_directly_with_the_bytecodes_result(tmp_path, monkeypatch) -> None:
    """The CPU step calls its compiled graph with the tensors dynamo's bytecode gathers (`graph_call`): the logits
    of every step equal bit for bit those of the same saved step called through its bytecode, weights changed in
    place between steps included."""
    from fewbits.decode import runner

    model = build("llama", torch.bfloat16)
    if why_eager(model) is not None:
        pytest.skip(why_eager(model))
    dec = StaticDecoder(model, "bf16", 2, 20, cache_dir=tmp_path)
    monkeypatch.setattr(runner, "graph_call", lambda fn, args: None)
    old = StaticDecoder(model, "bf16", 2, 20, cache_dir=tmp_path)
    assert dec.direct and not old.direct
    ids = torch.randint(4, 320, (2, 6), generator=torch.Generator().manual_seed(3))
    assert torch.equal(dec.prefill(ids), old.prefill(ids))
    for i, t in enumerate((7, 9, 11, 5)):
        if i == 2:
            with torch.no_grad():
                model.model.norm.weight.mul_(-2.0)
        tok = torch.tensor([t, t + 1])
        assert torch.equal(dec.step(tok), old.step(tok)), i
