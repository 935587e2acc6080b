"""Quantised GEMV/GEMM timing at decode shapes, through the kernel dispatcher.

A weight set is a list of (out, in) shapes, e.g. every linear layer of a model once.  To time what a
decode step sees (weights streamed from memory, not from cache) the set is replicated until it holds at
least `min_bytes`, and one "pass" multiplies an input by every weight of every copy once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fewbits.formats.format import parse_format
from fewbits.kernels import prepare_linear
from fewbits.tensor import quantize_tensor

#: the linear shapes (out, in) of one SmolLM2-135M block, and its (tied) LM head
SMOLLM2_BLOCK = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
SMOLLM2_HEAD = ((49152, 576),)
#: decode shapes of the GEMV benchmark: a Llama-3-8B MLP matrix and the SmolLM2 shapes
GEMV_SHAPES = ((14336, 4096), (1536, 576), (576, 1536), (576, 576), (192, 576))


@dataclass
class WeightSet:
    spec: str
    shapes: tuple[tuple[int, int], ...]
    kernels: list  # prepared kernels, copies x shapes
    nbytes: int  # bytes of one copy of the set in the format (exact, scales included)
    copies: int
    kernel_names: tuple[str, ...]

    def run(self, x_by_in: dict[int, torch.Tensor]) -> None:
        for k in self.kernels:
            k(x_by_in[k.shape[1]])

    def sampler(self, x_by_in: dict[int, torch.Tensor], per_sample: int) -> Callable[[], None]:
        """A callable that runs the next `per_sample` kernels, cycling through all copies: short samples
        (many of them, so that some fall between other processes' bursts) that still read cold weights."""
        ks, n, state = self.kernels, len(self.kernels), [0]

        def run() -> None:
            i = state[0]
            for j in range(per_sample):
                k = ks[(i + j) % n]
                k(x_by_in[k.shape[1]])
            state[0] = (i + per_sample) % n

        return run


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02


def effective_spec(spec: str, in_features: int) -> str:
    """`spec` itself, or the same format with the largest group size <= its own that divides in_features."""
    fmt = parse_format(spec)
    if fmt.granularity != "group" or in_features % fmt.group_size == 0:
        return fmt.spec
    g = fmt.group_size
    while g > 1 and in_features % g:
        g //= 2
    return fmt.with_group(g).spec


def build_set(spec: str, shapes: tuple[tuple[int, int], ...], min_bytes: int = 0, seed: int = 0) -> WeightSet:
    """Quantise random weights of `shapes` into `spec` (regrouping misfits) and prepare their kernels."""
    base = []
    nbytes = 0
    for i, shape in enumerate(shapes):
        s = effective_spec(spec, shape[1])
        w = _weight(shape, seed + i)
        if not parse_format(s).is_quantized:
            w = w.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[s])
        qt = quantize_tensor(w, s, name=f"{spec}{shape}")
        nbytes += qt.nbytes
        base.append(qt)
    copies = max(1, -(-min_bytes // max(nbytes, 1)))
    kernels = [prepare_linear(qt) for qt in base]
    for _ in range(1, copies):  # independent copies so that no pass finds the weights in cache
        kernels += [prepare_linear(_clone(qt)) for qt in base]
    names = tuple(dict.fromkeys(k.name for k in kernels))
    return WeightSet(spec, shapes, kernels, nbytes, copies, names)


def _clone(qt):
    from dataclasses import replace

    return replace(qt, codes=qt.codes.clone(),
                   scales=None if qt.scales is None else qt.scales.clone(),
                   zeros=None if qt.zeros is None else qt.zeros.clone())


def inputs_for(shapes: tuple[tuple[int, int], ...], rows: int = 1, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(rows, k, generator=g).to(dtype) for k in {s[1] for s in shapes}}
