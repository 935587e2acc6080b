"""Kernels that read their tensors through one block of memory by byte offsets (`Bindable`).

A compiled decode step takes every distinct tensor it reads as an input, and its C++ wrapper makes (and drops) a
handle for each input on every call: ~0.2 us each to make alone, their metadata cold after the step's stream of
weights (SmolLM2 int4-g64, batch 1: one more set of the step's 370 handles added 74 us to a 3.9 ms step).  The
decoder places all its weights in one mapping (`fewbits.decode.pages.place`); a kernel bound to a uint8 tensor over
that mapping (`Bindable.bind`) calls its operator's block variant with that tensor and the byte offsets of its own
tensors, so the step takes the one block instead of two or three tensors a linear layer.
"""

from __future__ import annotations

import copy

import torch


class Bindable:
    """A kernel whose operator has a variant that takes one block (a contiguous 1-D uint8 tensor) and the byte
    offsets of the kernel's tensors in it.  Subclasses say which tensors those are (`_bind_tensors`) and what the
    variant takes besides them (`_bind_args`); their call uses `_bound()` when it is not None."""

    _at: tuple | None = None  # the block variant's arguments after x (and before the path), where bound
    NOT_OWNED = ("_at",)  # the block is the decoder's: `fewbits.decode.pages.walk` does not count it as ours

    def _bind_tensors(self) -> tuple[torch.Tensor | None, ...] | None:
        """The tensors the block variant reads, in its order (None or an empty tensor: absent, offset -1); None
        where the operator this kernel calls has no block variant."""
        return None

    def _bind_args(self, block: torch.Tensor, offsets: tuple[int, ...]) -> tuple:
        """The block variant's arguments after x (and before the path) for `offsets` into `block`."""
        raise NotImplementedError

    def bind(self, block: torch.Tensor) -> bool:
        """Read this kernel's tensors through `block` by their offsets, where they all lie inside it (contiguous);
        False (nothing changes) otherwise, or where the operator has no block variant.  The tensors must stay where
        they are while bound: an uncompiled call checks that they have and unbinds if not (a compiled step keeps
        the offsets it traced)."""
        if block.dtype != torch.uint8 or block.dim() != 1 or not block.is_contiguous():
            raise ValueError("bind: the block must be a contiguous 1-D uint8 tensor")
        tensors = self._bind_tensors()
        if tensors is None:
            return False
        lo = block.data_ptr()
        hi = lo + block.numel()
        offsets = []
        for t in tensors:
            if t is None or t.numel() == 0:
                offsets.append(-1)
                continue
            p = t.data_ptr()
            if not (t.is_contiguous() and lo <= p and p + t.numel() * t.element_size() <= hi):
                return False
            offsets.append(p - lo)
        self._at = self._bind_args(block, tuple(offsets))
        self._offsets = tuple(offsets)
        return True

    def unbind(self) -> None:
        """Call the operator with the tensors themselves again."""
        self._at = None

    def _bound(self) -> tuple | None:
        """The block variant's arguments, or None; outside compilation also None (and unbound) where a tensor has
        moved since `bind` (`fewbits.decode.pages.place` moving it again)."""
        at = self._at
        if at is None or torch.compiler.is_compiling():
            return at
        base = at[0].data_ptr()
        tensors = self._bind_tensors() or ()
        for t, off in zip(tensors, self._offsets, strict=True):
            if off >= 0 and (t is None or t.data_ptr() != base + off):
                self._at = None
                return None
        return at

    def __deepcopy__(self, memo: dict[int, object]) -> Bindable:
        """A copy with tensors of its own, not bound to the original's block."""
        c = object.__new__(type(self))
        memo[id(self)] = c
        c.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("_at", "_offsets")},
                                        memo))
        return c
