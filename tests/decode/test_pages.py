"""Tensors moved into huge pages keep their identity, values, layout and aliasing; the decoder places its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fewbits.decode import pages
from fewbits.decode.pages import Placement, place, tensors_of, why_not_huge

needs_madvise = pytest.mark.skipif(why_not_huge(huge=False) is not None, reason=f"{why_not_huge(huge=False)}")


class Kernel:  # stands for a fewbits kernel object: tensors held as plain attributes
    __module__ = "fewbits.test_kernel"

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes
        self.first_rows = codes[:64]  # a view of the same storage
        self.parts = [codes[64:], torch.arange(10)]  # tensors in a list; a small one stays put
        raw = torch.randint(0, 255, (100_000,), dtype=torch.uint8)
        self.odd, self.words = raw[3:], raw[4:].view(torch.int32)  # views in two dtypes, one at an odd byte


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512, bias=False))
    m.kernel = Kernel(torch.randint(-128, 127, (256, 4096), dtype=torch.int8))
    m.register_buffer("table", torch.randn(300, 700, dtype=torch.bfloat16)[:, 100:600])  # strided, offset view
    return m


@needs_madvise
@pytest.mark.parametrize("huge", [True, False])
def test_place_keeps_every_tensor_its_values_layout_and_aliasing(huge: bool) -> None:
    if huge and why_not_huge() is not None:
        pytest.skip(why_not_huge())
    m = _model()
    ts = tensors_of([m])
    before = {id(t): (t.clone(), t.stride(), t.dtype, t.requires_grad) for t in ts}
    objects = {id(t) for t in ts}
    old = m[0].weight.data_ptr()
    got = place([m], huge=huge)
    assert got.why_not is None and got.address % pages.HUGE == 0
    # moved: the two weights (2 MiB each), the kernel's codes (1 MiB, three tensors view it), the byte buffer
    # (two views), the buffer's storage (420 KB); the bias (4 KiB) and the small list entry are under MIN_BYTES
    assert got.storages == 5 and got.tensors == 8
    assert m[0].weight.data_ptr() != old
    for t in tensors_of([m]):
        assert id(t) in objects  # the same objects (parameters stay parameters)
        ref, stride, dtype, grad = before[id(t)]
        assert torch.equal(t, ref) and t.stride() == stride
        assert t.dtype == dtype and t.requires_grad == grad
    moved = [m[0].weight, m[1].weight, m.kernel.codes, m.table]
    assert all(got.address <= t.data_ptr() < got.address + got.nbytes for t in moved)
    # tensors that viewed different storages still do (a compiled step treats views of one storage as aliases)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 4
    assert m.kernel.first_rows.untyped_storage().data_ptr() == m.kernel.codes.untyped_storage().data_ptr()
    assert m.kernel.parts[1].data_ptr() < got.address or m.kernel.parts[1].data_ptr() >= got.address + got.nbytes
    # views of one storage still view one storage, at the same places: a write through one is read through the others
    codes = m.kernel.codes
    assert m.kernel.first_rows.data_ptr() == codes.data_ptr()
    assert m.kernel.parts[0].data_ptr() == codes.data_ptr() + 64 * 4096
    # views of one byte buffer as bytes from an odd offset and as int32 words
    assert m.kernel.words.data_ptr() == m.kernel.odd.data_ptr() + 1
    m.kernel.words[0] = 0x01020304
    assert m.kernel.odd[1:5].tolist() == [4, 3, 2, 1]
    m.kernel.codes[0, 0] = 7
    m.kernel.codes[100, 5] = -3
    assert m.kernel.first_rows[0, 0] == 7 and m.kernel.parts[0][36, 5] == -3
    # the module computes what it did
    x = torch.randn(3, 512)
    torch.testing.assert_close(m(x), torch.nn.functional.linear(
        torch.nn.functional.linear(x, before[id(m[0].weight)][0], before[id(m[0].bias)][0]),
        before[id(m[1].weight)][0]), rtol=0, atol=0)


@needs_madvise
def test_the_block_starts_on_the_boundary_and_offsets_do_not_depend_on_the_mapping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`Placement.block` starts where the placed bytes do (on a huge-page boundary), wherever the kernel put the
    mapping: the same tensors placed again, in another mapping, lie at the same offsets in its block (a compiled
    step bakes those offsets, and loads in the next process only if they are the same there)."""
    monkeypatch.setattr(pages, "HUGE", 64 << 10)  # 16 possible starts of a mapping (4 KiB pages) modulo this
    m = _model()
    first = place([m], huge=False, min_bytes=0)  # every tensor, as the decoder places its weights
    ts = tensors_of([m])
    offsets = [t.data_ptr() - first.block.data_ptr() for t in ts]
    assert all(0 <= o < first.block.numel() for o in offsets)
    second = place([m], huge=False, again=True, min_bytes=0)
    for p in (first, second):
        assert p.block.data_ptr() == p.address and p.address % pages.HUGE == 0
        assert p.nbytes <= p.block.numel() < p.nbytes + pages.ALIGN * p.storages
    assert second.address != first.address
    assert [t.data_ptr() - second.block.data_ptr() for t in ts] == offsets


@needs_madvise
def test_place_twice_moves_nothing_the_second_time() -> None:
    m = _model()
    first = place([m], huge=False)
    ptr = m[0].weight.data_ptr()
    second = place([m], huge=False)
    assert first.nbytes > 0 and second.nbytes == 0 and second.why_not is not None
    assert m[0].weight.data_ptr() == ptr


def test_place_does_nothing_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEWBITS_HUGE_PAGES", "0")
    m = _model()
    ptr = m[0].weight.data_ptr()
    assert place([m]) == Placement(why_not="FEWBITS_HUGE_PAGES=0")
    assert m[0].weight.data_ptr() == ptr


def test_place_does_nothing_where_huge_pages_are_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if why_not_huge(huge=False) is not None:
        pytest.skip(why_not_huge(huge=False))
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(pages, "THP_SETTING", setting)
    m = _model()
    got = place([m])
    assert got.nbytes == 0 and "never" in got.why_not


@needs_madvise
def test_a_placed_mapping_is_backed_by_huge_pages_where_the_kernel_gives_them() -> None:
    if why_not_huge() is not None:
        pytest.skip(why_not_huge())
    m = torch.nn.Linear(2048, 4096)  # 32 MiB of weight: sixteen huge pages
    got = place([m])
    if got.huge_bytes() == 0:
        pytest.skip("the kernel gave this mapping no huge pages (memory too fragmented, or khugepaged policy)")
    assert got.huge_bytes() >= 16 * pages.HUGE
    assert pages.mapping_huge_bytes(m.weight.data_ptr()) == got.huge_bytes()


@needs_madvise
def test_the_cpu_decoder_places_its_weights_and_cache_and_decodes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    if why_not_huge() is not None:
        pytest.skip(why_not_huge())
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from fewbits.decode.runner import StaticDecoder

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2))
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 1024, (1, 6))

    def tokens(dec: StaticDecoder) -> list[int]:
        out = [int(dec.prefill(ids)[0, -1].argmax())]
        for _ in range(5):
            out.append(int(dec.step(torch.tensor([out[-1]]))[0].argmax()))
        return out

    placed = StaticDecoder(model, "bf16", 1, 4096, compile=False)  # 1 MiB of cache a layer's k and v
    # the weights in one mapping, the cache in another (the weights' block does not depend on the cache)
    for got, big in ((placed.placement, [p for p in model.parameters() if p.numel() * p.element_size() >= 4096]),
                     (placed.cache_placement, [t for layer in placed.cache for t in layer.t.values()])):
        assert got.why_not is None and len(big) > 3
        assert all(got.address <= t.data_ptr() < got.address + got.nbytes for t in big)
    monkeypatch.setenv("FEWBITS_HUGE_PAGES", "0")
    plain = StaticDecoder(twin, "bf16", 1, 4096, compile=False)
    assert plain.placement.nbytes == 0 and plain.cache_placement.nbytes == 0
    assert tokens(placed) == tokens(plain)


def test_the_walk_meets_tensors_in_their_own_order():
    """First child first: a module's parameters and submodules as registered, a list's items in turn, the roots
    in turn (the order `place` lays them out in)."""
    a, b, c = (torch.nn.Linear(4, 4) for _ in range(3))
    seq = torch.nn.Sequential(a, b)
    extra = [torch.zeros(3), torch.ones(3)]
    got = tensors_of([seq, c, extra])
    want = [a.weight, a.bias, b.weight, b.bias, c.weight, c.bias, *extra]
    assert [id(t) for t in got] == [id(t) for t in want]


@needs_madvise
def test_place_lays_a_models_layers_out_in_the_order_a_step_reads_them():
    """A decode step reads layer 0's weights, then layer 1's, ...: in the arena they lie at rising addresses (the
    probe's passes laid out the other way round ran 2-6% slower)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": torch.nn.Linear(256, 256, bias=False),
                                                      "mlp": torch.nn.Linear(256, 1024, bias=False)})
                                 for _ in range(6))
    placement = place([layers], huge=False)
    assert placement.nbytes > 0, placement.why_not
    reads = [m.weight.data_ptr() for layer in layers for m in (layer["attn"], layer["mlp"])]
    assert reads == sorted(reads) and len(set(reads)) == len(reads)
