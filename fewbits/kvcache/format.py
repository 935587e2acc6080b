"""KV-cache formats: what each cached key/value costs in bytes, and how many tokens fit in a budget.

The formats (fp8-e4m3, int8, KIVI int4/int2 with a 16-bit residual window) and their byte accounting
live in `fewbits.formats.kvformat`, which is pure Python so that the cost model counts a cache's bytes with
the very code the store reports them with; this module is their name inside the KV-cache package.
"""

from fewbits.formats.kvformat import FLOAT_BYTES, KV_SPECS, SCALE_BYTES, KVFormat, parse_kv_format

__all__ = ["FLOAT_BYTES", "KV_SPECS", "SCALE_BYTES", "KVFormat", "parse_kv_format"]
