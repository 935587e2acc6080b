"""Swapping Linear -> QuantLinear one layer at a time, and the true size of a model."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from fewbits.models.qlinear import QuantLinear
from fewbits.models.swap import (
    linear_layers,
    linear_shapes,
    model_nbytes,
    replace_module,
    swap_in,
    tied_parameters,
)
from fewbits.tensor import quantize_tensor


class Tiny(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.ModuleDict({"up": nn.Linear(16, 24), "down": nn.Linear(24, 16, bias=False)})
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_linear_layers_and_shapes():
    m = Tiny()
    assert [n for n, _ in linear_layers(m)] == ["block.up", "block.down", "head"]
    assert linear_shapes(m) == [("block.up", (24, 16)), ("block.down", (16, 24)), ("head", (32, 16))]


def test_model_nbytes_counts_tied_weights_once():
    m = Tiny(tie=True)
    want = 4 * (32 * 16 + 24 * 16 + 24 + 16 * 24)  # embed (= head), up + bias, down
    assert model_nbytes(m) == want
    assert model_nbytes(Tiny(tie=False)) == want + 4 * 32 * 16


def test_swap_in_keeps_bias_releases_weight_and_matches():
    m = Tiny()
    x = torch.randn(3, 16)
    old = m.block.up
    ref = weakref.ref(old.weight)
    qt = quantize_tensor(old.weight, "int8")
    want = torch.nn.functional.linear(x, qt.dequantize(), old.bias)
    new = swap_in(m, "block.up", qt)
    assert isinstance(m.block.up, QuantLinear) and new is m.block.up
    assert torch.equal(m.block.up(x), want)
    del old, qt
    gc.collect()
    assert ref() is None  # the float weight is gone
    # tied weights are never released from under the embedding
    swap_in(m, "head", quantize_tensor(m.head.weight, "int8"))
    assert m.embed.weight is not None and m.embed.weight.shape == (32, 16)


def test_swap_in_with_the_tied_set_releases_exactly_the_untied_weights():
    m = Tiny(tie=True)
    tied = tied_parameters(m)
    assert tied == {id(m.embed.weight)} and tied_parameters(Tiny(tie=False)) == set()
    head, up = m.head, m.block.up
    swap_in(m, "head", quantize_tensor(head.weight, "int8"), tied=tied)
    assert head.weight is m.embed.weight  # tied: the old head keeps it (the embedding still uses it)
    swap_in(m, "block.up", quantize_tensor(up.weight, "int8"), tied=tied)
    assert up.weight is None  # untied: released


def test_swap_in_rejects_wrong_shape_and_accepts_modules():
    m = Tiny()
    try:
        swap_in(m, "block.up", quantize_tensor(torch.randn(16, 24), "int8"))
    except ValueError as e:
        assert "block.up" in str(e) and "(16, 24)" in str(e)
    else:
        raise AssertionError("shape mismatch accepted")
    ident = nn.Identity()
    swap_in(m, "block.down", ident)
    assert m.block.down is ident
    assert isinstance(replace_module(m, "head", nn.Identity()), nn.Linear)
