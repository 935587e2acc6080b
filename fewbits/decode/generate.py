"""`generate_static`: `fewbits.generate.generate` on the compiled static-cache path, with the same result type.

A `StaticDecoder` is kept per (model, KV format, batch, cache length) on the model itself (an attribute, so
model and decoders are collected together), so a bench that decodes the same shapes again reuses the
compiled step instead of compiling it again.  Where the
compiled path cannot run (`why_eager`), the eager `generate` runs and the result says why (logged once
per reason).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fewbits.decode.runner import StaticDecoder, cache_slots, compile_scope, why_eager
from fewbits.generate import GenerationResult, attention_backends, decode_loop, generate, synchronizer
from fewbits.kvcache.format import KVFormat, parse_kv_format

log = logging.getLogger("fewbits.decode")
_LOGGED: set[str] = set()


class Decoders(dict):
    """A model's decoders by shape, held on the model, that pickle as an empty dict.

    The compiled step of a second shape is traced over the same model, and its saved guards
    (`fewbits.decode.precompiled`) pickle the model's attributes: this dict among them, with the first
    decoder's compiled step in it, whose guard manager does not pickle ("cannot pickle RootGuardManager"),
    so only a model's first step was ever saved and every other compiled anew in the next process."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (dict, ())


def decoder_for(model: torch.nn.Module, kv: KVFormat | str, batch: int, max_len: int) -> StaticDecoder:
    """The model's compiled decoder for these shapes, built (compiled) on first use."""
    from fewbits.decode import cache

    f = parse_kv_format(kv)
    slots = cache_slots(max_len, f, next(model.parameters()).device)
    key = (f.full_spec, batch, slots, cache.NATIVE_APPEND, cache.APPEND_WITHOUT_WINDOW)
    per_model = model.__dict__.get("_fewbits_decoders")
    if not isinstance(per_model, Decoders):
        per_model = model.__dict__["_fewbits_decoders"] = Decoders(per_model or {})
    dec = per_model.get(key)
    if dec is None:
        dec = per_model[key] = StaticDecoder(model, f, batch, max_len)
    else:
        dec.compile_s = 0.0  # already compiled: this call compiles nothing
    return dec


@torch.no_grad()
def generate_static(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, kv: KVFormat | str = "bf16",
                    attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
                    seed: int | None = None, between: Callable[[], None] | None = None) -> GenerationResult:
    """`generate` through the compiled step; `compile_s` holds the compile (or cache load) time, apart from
    `decode_step_s`.  `between`: run before each step, outside its time (`decode_loop`)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, tokens) with at least one token, got {tuple(input_ids.shape)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    why = why_eager(model, device)
    B, T = input_ids.shape
    dec = None
    if why is None:
        try:
            dec = decoder_for(model, kv, B, T + max_new_tokens)
        except (ValueError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - a compiler failure: decode eagerly, say why
            why = f"compiling the step failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if why is not None:
        if why not in _LOGGED:
            _LOGGED.add(why)
            log.warning("fewbits.decode: running eagerly: %s", why)
        res = generate(model, input_ids, max_new_tokens, kv, attention_mask, do_sample, temperature, top_k, top_p,
                       eos_token_id, seed, between=between)
        res.eager_reason = why
        return res
    assert dec is not None
    ids = input_ids.to(device)
    mask = (attention_mask if attention_mask is not None else torch.ones_like(ids)).to(device).long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    with attention_backends(device), compile_scope():
        tokens, prefill_s, steps = decode_loop(lambda: dec.prefill(ids, mask), dec.step, max_new_tokens,
                                               synchronizer(device), do_sample, temperature, top_k, top_p,
                                               eos_token_id, gen, between)
    return GenerationResult(tokens, T, prefill_s, steps, dec.kv_nbytes, dec.fmt.spec,
                            path="compiled", compile_s=dec.compile_s)
