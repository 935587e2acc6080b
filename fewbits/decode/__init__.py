"""A compiled decode path: a preallocated KV cache in any fewbits format, one fixed graph per step."""

from fewbits.decode.runner import StaticDecoder, compile_scope, inductor_cache_dir, why_eager

__all__ = ["StaticDecoder", "compile_scope", "inductor_cache_dir", "why_eager"]
