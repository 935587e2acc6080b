"""Checkpoints for serving engines, one file per target: compressed-tensors (vLLM), GGUF (llama.cpp)."""

from fewbits.export.common import ExportError
from fewbits.export.compressed_tensors import check_formats, export_compressed_tensors

__all__ = ["ExportError", "check_formats", "export_compressed_tensors"]
