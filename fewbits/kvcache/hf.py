"""A transformers `Cache` whose layers are fewbits `KVStore`s: quantised on every write, preallocated.

    cache = QuantizedKVCache("int4", n_layers=model.config.num_hidden_layers, max_len=prompt + new_tokens)
    out = model(input_ids, **cache_kwargs(model, cache), use_cache=True)

The attention modules of Llama/Gemma/Qwen-style models call `cache.update(k, v, layer_idx)` with the
new keys/values of every forward (prefill and decode); the layer writes them through the quantiser and
returns the whole (dequantised) history, which the model's own attention then uses.

Pass the cache under the name the model's forward takes (`cache_kwargs`): transformers renamed
``past_key_values`` to ``cache``, and a model that does not know ``cache`` swallows it unused, running
without any cache (silently: the outputs then look like a perfect cache's).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from fewbits.kvcache.format import KVFormat, parse_kv_format
from fewbits.kvcache.store import KVStore


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's cache, backed by a `KVStore` allocated on the first write."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, fmt: KVFormat | str, max_len: int) -> None:
        super().__init__()
        self.fmt = parse_kv_format(fmt)
        self.max_len = max_len
        self.store: KVStore | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.store = KVStore(self.fmt, B, H, D, self.max_len, dtype=key_states.dtype, device=key_states.device,
                             head_dim_v=value_states.shape[-1])
        self.device = key_states.device
        self.batch_size = B
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        self.store.append(key_states, value_states)
        return self.store.read()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.length if self.store is not None else 0

    def get_max_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()

    def offload(self) -> None:  # the store stays where it was allocated
        return None

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the quantised KV cache does not support beam search reordering")


class QuantizedKVCache(Cache):
    """A cache of `n_layers` `QuantizedKVLayer`s in one KV format, each holding up to `max_len` tokens."""

    def __init__(self, fmt: KVFormat | str, n_layers: int, max_len: int) -> None:
        if n_layers <= 0 or max_len <= 0:
            raise ValueError(f"need n_layers > 0 and max_len > 0, got {n_layers} and {max_len}")
        self.fmt = parse_kv_format(fmt)
        super().__init__(layers=[QuantizedKVLayer(self.fmt, max_len) for _ in range(n_layers)])

    @property
    def nbytes(self) -> int:
        """Exact bytes held for the tokens written so far, all layers."""
        return sum(layer.store.nbytes for layer in self.layers if layer.store is not None)

    @property
    def allocated_nbytes(self) -> int:
        return sum(layer.store.allocated_nbytes for layer in self.layers if layer.store is not None)


def cache_for(model: torch.nn.Module, fmt: KVFormat | str, max_len: int) -> QuantizedKVCache:
    """A cache sized for `model` (its config's number of hidden layers)."""
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return QuantizedKVCache(fmt, int(text_cfg.num_hidden_layers), max_len)


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """{name: cache} for `model(..., **cache_kwargs(model, cache))`: ``cache`` where the model's forward takes
    that name (transformers >= 5.2x), else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}

