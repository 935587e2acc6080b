"""fewbits: quantise LLMs for inference, predict what it buys, measure what it costs.

Importing `fewbits` is cheap: torch is loaded only when a tensor-level name is used.
"""

from __future__ import annotations

from typing import Any

from fewbits.formats.format import Format, FormatError, parse_format

__version__ = "0.1.0"

_LAZY = {
    "QuantizedTensor": "fewbits.tensor",
    "quantize_tensor": "fewbits.tensor",
    "save_quantized": "fewbits.tensor",
    "load_quantized": "fewbits.tensor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fewbits' has no attribute {name!r}")


__all__ = ["Format", "FormatError", "parse_format", *_LAZY]
