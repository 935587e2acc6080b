"""Quantised KV cache: formats and their bytes, a preallocated store per layer, a transformers Cache."""

from fewbits.kvcache.format import KV_SPECS, KVFormat, parse_kv_format
from fewbits.kvcache.store import KVStore

__all__ = ["KV_SPECS", "KVFormat", "KVStore", "parse_kv_format"]
