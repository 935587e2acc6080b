"""QuantLinear: a linear layer whose weight is stored as a packed `QuantizedTensor`.

The packed tensors (codes, scales, zero points, tensor scale) are registered as buffers named
``qweight_codes``, ``qweight_scales``, ... so `state_dict()` / `load_state_dict()` see exactly what is
stored; the format and shape live in `qweight_meta` (JSON-able, the QuantizedTensor's `meta()`).

The matmul runs through `self.kernel`, a callable ``kernel(x, bias) -> y`` prepared once per layer by a
*chooser* ``chooser(qt) -> kernel``.  A QuantLinear built without one runs the reference path,
dequantise then matmul (`reference_linear`): cheap to build, exact.  The api (`fewbits.api.quantize`,
`load_quantized_model`) prepares the kernel dispatcher on every layer of a finished model by default;
`kernel_name` says which kernel a layer runs.

The codes are held once.  A kernel that keeps the codes in a layout of its own (fewbits' CPU int4 operator
repacks them into 64-byte chunks, the int8 operators shift them to signed) and can give them back exactly,
``kernel.unpacked_codes()`` (and, where it can do it faster, ``kernel.packed_codes(bits)``: the CPU int4 operator's
4-bit chunks turn straight into the stored packing), lets the layer drop its ``qweight_codes`` buffer (checked equal
when dropped):
else every such layer held its weight twice (SmolLM2-135M int4-g64: 56 MB of packed buffers beside the
kernels' 56 MB).  The codes come back, packed, wherever they are read: `qweight`, `state_dict()` (saving and
exporting see the same tensors as before), a move (`model.to`) or another kernel (`set_kernel`), and
`weight_nbytes` counts them.

Saved layers.  A module that replaces a linear layer describes itself for the saved metadata and is
rebuilt from it, one mechanism for every such module: its class names a `layer_kind` listed in
`LAYER_KINDS`, `layer_meta()` gives its JSON-able parameters (tensors stay in the state dict), and the
classmethod `from_layer_meta(meta, source)` rebuilds it from those parameters and the saved tensors.
Child modules that are layers themselves (a wrapper around a QuantLinear) are described and rebuilt by
the same walk (`describe_layer` / `rebuild_layer`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fewbits.formats.format import Format
from fewbits.formats.packing import pack_bits
from fewbits.tensor import QuantizedTensor

PREFIX = "qweight_"
CODES = PREFIX + "codes"  # the buffer a kernel holding the codes lets the layer drop
#: a prepared matmul for one weight: kernel(x, bias) -> y
LinearKernel = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
#: picks a kernel for a weight (by format, shape, device)
KernelChooser = Callable[[QuantizedTensor], LinearKernel]


def reference_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(qt)^T + bias, computed in the dtype of `x`. x (..., in), qt (out, in) -> (..., out)."""
    if x.shape[-1] != qt.shape[-1]:
        raise ValueError(f"input last dimension {x.shape[-1]} does not match weight shape {qt.shape} "
                         f"(format {qt.fmt.spec})")
    w = qt.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def reference_chooser(qt: QuantizedTensor) -> LinearKernel:
    """QuantLinear's own default chooser: always the reference path (dequantise on every call)."""
    kernel = partial(_call_reference, qt)
    kernel.name = "reference"  # type: ignore[attr-defined]
    return kernel


def kernel_name(kernel: LinearKernel) -> str:
    """The name of a prepared kernel: "reference", "cached", or the dispatcher's ("cpu_int4pack", ...)."""
    return str(getattr(kernel, "name", None) or type(kernel).__name__)


def _call_reference(qt: QuantizedTensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return reference_linear(x, qt, bias)


class DequantizedOnce:
    """The reference path with the dequantised weight kept after the first call (one per dtype/device).

    Gives exactly the numbers of `reference_linear` (same dequantisation, same cast, same matmul), but
    holds a dense copy of the weight: use it for evaluation runs on the CPU, where dequantising every
    layer on every forward costs more than the matmul; never for measuring memory or kernel speed.
    """

    name = "cached"

    def __init__(self, qt: QuantizedTensor) -> None:
        self.qt = qt
        self.dense: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (x.dtype, x.device)
        w = self.dense.get(key)
        if w is None:
            w = self.dense[key] = self.qt.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def dequantized_once_chooser(qt: QuantizedTensor) -> LinearKernel:
    """Chooser for evaluation on the CPU: `DequantizedOnce` for every layer."""
    return DequantizedOnce(qt)


class QuantLinear(nn.Module):
    """Drop-in replacement for `nn.Linear` holding only the packed weight (and the bias)."""

    layer_kind: ClassVar[str] = "quant_linear"

    def __init__(self, qweight: QuantizedTensor, bias: torch.Tensor | None = None,
                 chooser: KernelChooser | None = None) -> None:
        super().__init__()
        if len(qweight.shape) != 2:
            raise ValueError(f"QuantLinear needs a 2-D weight (out, in), got shape {qweight.shape}")
        self.out_features, self.in_features = (int(d) for d in qweight.shape)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight shape {qweight.shape}")
        self.qweight_meta: dict[str, Any] = qweight.meta()
        for key, t in qweight.state_dict(PREFIX).items():
            self.register_buffer(key, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.codes_holder: Any = None  # the kernel that holds the codes once the buffer is dropped
        self.set_kernel(chooser or reference_chooser)

    def set_kernel(self, chooser: KernelChooser | None = None) -> None:
        """Prepare the matmul with `chooser` (default: the layer's own) and, where the new kernel can give the
        codes back exactly, drop the packed codes buffer (module docstring)."""
        if chooser is not None:
            self.chooser = chooser
        self._restore_codes()
        qt = self.qweight
        self.kernel: LinearKernel = self.chooser(qt)
        back = getattr(self.kernel, "unpacked_codes", None)
        if back is None or not (qt.fmt.is_quantized and torch.equal(back(), qt.unpacked_codes())):
            return
        self.codes_holder = self.kernel
        self._buffers[CODES] = None

    def _codes(self) -> torch.Tensor:
        """The packed codes: the buffer, or rebuilt from the kernel that holds them."""
        codes = self._buffers.get(CODES)
        if codes is None:
            k, bits = self.codes_holder, self.fmt.bits
            codes = k.packed_codes(bits) if hasattr(k, "packed_codes") else pack_bits(k.unpacked_codes(), bits)
        return codes

    def _restore_codes(self) -> None:
        """The codes buffer back (before the kernel that holds the codes changes)."""
        if self.codes_holder is not None:
            self._buffers[CODES] = self._codes()
            self.codes_holder = None

    @property
    def qweight(self) -> QuantizedTensor:
        """The packed weight, built over the current buffers (no copy; codes held by the kernel are rebuilt)."""
        bufs = {k: b for k, b in self._buffers.items() if b is not None}
        bufs[CODES] = self._codes()
        return QuantizedTensor.from_state_dict(bufs, PREFIX, self.qweight_meta)

    @property
    def fmt(self) -> Format:
        """The weight's format (from the metadata: no codes rebuilt)."""
        return Format.from_dict(self.qweight_meta["format"])

    @property
    def fmt_spec(self) -> str:
        return self.fmt.spec

    @property
    def held_codes_nbytes(self) -> int:
        """Bytes of the packed codes when the kernel holds them instead of the buffer (else 0)."""
        if self.codes_holder is None:
            return 0
        return self.out_features * -(-int(self.qweight_meta["shape"][-1]) * self.fmt.bits // 8)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the packed weight as stored (codes held by the kernel counted as their packed size)."""
        return self.held_codes_nbytes + sum(b.numel() * b.element_size() for k, b in self._buffers.items()
                                            if b is not None and k.startswith(PREFIX))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantLinear:
        """Moving between devices moves the packed buffers; a dtype cast (model.to(bf16)) never touches them
        (scales keep their stored dtype, so the stored values stay exact).  The kernel is prepared again."""
        if "codes_holder" in self.__dict__:
            self._restore_codes()
        orig = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for k, t in orig.items():
            new = self._buffers[k]
            if new is not None and new.dtype != t.dtype:
                self._buffers[k] = t.to(new.device)
        if "kernel" in self.__dict__:
            self.set_kernel()
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.codes_holder is not None:
            destination[prefix + CODES] = self._codes()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        self._restore_codes()  # a buffer for the saved codes to load into
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.set_kernel()

    def layer_meta(self) -> dict[str, Any]:
        """Saved parameters: the packed weight's format and shape, whether there is a bias."""
        return {"qweight": self.qweight_meta, "bias": self.bias is not None}

    @classmethod
    def from_layer_meta(cls, meta: dict[str, Any], source: LayerSource) -> QuantLinear:
        qt = QuantizedTensor.from_state_dict(source.tensors, f"{source.prefix}.{PREFIX}", meta["qweight"])
        bias = source.tensors.get(f"{source.prefix}.bias")
        if bias is None and meta.get("bias"):  # a tied bias saved under another name: filled by load_state_dict
            bias = torch.zeros(int(qt.shape[0]))
        return cls(qt, bias, source.chooser)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.qweight_meta['format']['spec']}, bias={self.bias is not None}")


# ---------------------------------------------------------------------- saved layers
#: saved layer kind -> "module:Class" able to rebuild it; add a layer module with one line here
LAYER_KINDS: dict[str, str] = {
    "quant_linear": "fewbits.models.qlinear:QuantLinear",
    "act_quant": "fewbits.methods.smoothquant:ActQuantLinear",  # W8A8: int8 per-token activations
    "int8_outlier": "fewbits.methods.llm_int8:Int8OutlierLinear",  # LLM.int8() outlier split
}


class LayerMetaError(ValueError):
    """A saved layer description that cannot be rebuilt (unknown kind, missing or mismatched fields)."""


@dataclass
class LayerSource:
    """What `from_layer_meta` rebuilds a layer from: the saved tensors (full state-dict names), the layer's
    dotted name, the kernel chooser for packed weights, and its child layers, already rebuilt."""

    tensors: dict[str, torch.Tensor]
    prefix: str
    chooser: KernelChooser | None = None
    children: dict[str, nn.Module] = field(default_factory=dict)

    def tensor(self, key: str) -> torch.Tensor:
        name = f"{self.prefix}.{key}"
        if name not in self.tensors:
            raise KeyError(f"tensor {name} is missing")
        return self.tensors[name]


def describe_layer(module: nn.Module, name: str = "layer") -> dict[str, Any] | None:
    """{"kind": ..., parameters..., "children": {child: description}} of a module that describes itself,
    None for any other module (its parameters are plain state-dict entries)."""
    kind = getattr(type(module), "layer_kind", None)
    if kind is None:
        return None
    if kind not in LAYER_KINDS:
        raise LayerMetaError(f"{name}: layer kind {kind!r} of {type(module).__name__} is not in LAYER_KINDS, "
                             "so it could not be loaded again")
    meta = {"kind": kind, **module.layer_meta()}
    kids = {c: d for c, child in module.named_children() if (d := describe_layer(child, f"{name}.{c}"))}
    if kids:
        meta["children"] = kids
    return meta


def describe_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Dotted name -> description of every outermost module of `model` that describes itself."""
    out: dict[str, dict[str, Any]] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for c, child in mod.named_children():
            name = f"{prefix}.{c}" if prefix else c
            d = describe_layer(child, name)
            if d is not None:
                out[name] = d
            else:
                walk(child, name)

    walk(model, "")
    return out


def rebuild_layer(meta: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str,
                  chooser: KernelChooser | None = None) -> nn.Module:
    """The module `describe_layer` described, rebuilt over the saved tensors of layer `prefix`."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind not in LAYER_KINDS:
        raise LayerMetaError(f"layer {prefix}: unknown layer kind {kind!r} (known: {', '.join(LAYER_KINDS)})")
    children = {c: rebuild_layer(m, tensors, f"{prefix}.{c}", chooser) for c, m in meta.get("children", {}).items()}
    module, attr = LAYER_KINDS[kind].split(":")
    cls = getattr(importlib.import_module(module), attr)
    try:
        return cls.from_layer_meta(meta, LayerSource(tensors, prefix, chooser, children))
    except LayerMetaError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # FormatError is a ValueError
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise LayerMetaError(f"layer {prefix} ({kind}): {msg}") from e
