"""One forward pass of a supported decoder over the static cache: a prompt (prefill, Python-int slots) or one
token per sequence (a decode step, every index a tensor: one fixed graph for all steps).

The model's own modules do everything but attention (embedding, norms, projections with their quantised
kernels, rotary embedding, MLP, LM head); attention reads `fewbits.decode.cache.LayerKV`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fewbits.decode import kvkernel
from fewbits.decode.arch import Arch
from fewbits.decode.cache import NEG, LayerKV
from fewbits.decode.fuse import Fused, LayerFusion
from fewbits.kernels import rows, wide16


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The rotary sine with its first half negated: `_rope` then needs no rotated copy of its input."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding x * cos + rotate_half(x) * sin, with `ssin` = `_signed_sin(sin)`: rotate_half(x) is
    (-x2, x1), so its product with sin is roll(x) * ssin, bit for bit (a negation is exact either side of the
    product).  Compiled, the roll is an index inside one pointwise loop where rotate_half's `cat` made inductor
    write the rotated halves in loops of their own, each ending at a barrier of the step's threads (SmolLM2 int4-g64,
    batch 8, inductor's kernel profile: the layer's rotary kernel 11.6 us, 9.6 with cos / sin stored once a step,
    7.5 with the roll).  The roll by half of D is written as the two halves swapped (a flip of a (2, D/2) view):
    inductor reads `roll`'s index modulo D element by element into a buffer, the swapped halves as whole vectors
    (the kernel 8.6 -> 5.5 us another day; the step 1.01x faster, alternating with the roll in one process)."""
    half = x.shape[-1] // 2
    return x * cos + x.unflatten(-1, (2, half)).flip(-2).flatten(-2) * ssin


def _stored(x: torch.Tensor) -> torch.Tensor:
    """`x` itself, but stored once by a compiled graph instead of recomputed where it is used.

    Inductor inlines a pointwise result into every consumer; the query's rotary embedding (a cos and a
    sin per element) was recomputed for each of the T cache slots inside the score reduction, ~0.4 ms a
    layer at 256 slots, the largest part of a SmolLM2 step.  A strided view needs a stored buffer, so it
    makes inductor write the value once (eagerly it is a no-op view)."""
    return x.as_strided(x.shape, x.stride())


def _attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """q (B, Hq, n, D), k/v (B, Hkv, T, D) 16-bit, allowed (B, n, T) -> (B, Hq, n, D)."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed[:, None],
                                          scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


def _attend_codes(q: torch.Tensor, kv: LayerKV, allowed: torch.Tensor, slot: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """One query token per sequence over a layer's cache: q (B, Hq, 1, D), allowed (B, 1, T), slot (1,).

    16-bit, int8, KIVI and fp8 caches on a CPU go through `fewbits.decode.kvkernel` (one operator: each row
    read once for all the query heads of a KV head, scales folded out of the loops, tokens in parallel chunks;
    `attend_rows`, for 16-bit caches and int8 / fp8 ones without a window, reads slots up to `slot` only);
    otherwise the scores and the weighted sum of values are reductions over the stored rows with the scales
    and minima folded out of them (`LayerKV.scores`, `LayerKV.weighted_values`), fused by inductor.  Neither
    stores a dequantised copy."""
    B, Hq, _, D = q.shape
    f = kv.fmt
    Hkv, T = kv.t["k" if f.kind == "float" else "kc"].shape[1:3]
    allowed = allowed[:, :, :T]
    if kv.kernel and (f.kind == "float" or (f.kind in ("int8", "fp8") and not kv.ring)):  # whole rows, to the slot
        t = kv.t
        k, v, ks, vs = (t["k"], t["v"], q.new_empty(0), q.new_empty(0)) if f.kind == "float" else \
            (t["kc"], t["vc"], t["ks"], t["vs"])
        out = torch.ops.fewbits_kv.attend_rows(q.view(B, Hkv, Hq // Hkv, D), scaling, k, v, ks, vs, allowed, slot,
                                               kvkernel.CHUNK_ROWS)
        return out.reshape(B, Hq, 1, D)
    if kv.kernel:  # the masks of the window and of the quantised slots are computed inside
        t = kv.t
        km, vm = (t["km"], t["vm"]) if f.kind == "kivi" else (t["ks"], t["vs"])  # int8: no minima (unused)
        rk, rv = (t["rk"], t["rv"]) if kv.ring else (q.new_empty(0), q.new_empty(0))
        out = torch.ops.fewbits_kv.attend_kv(q.view(B, Hkv, Hq // Hkv, D), scaling, f.bits, kv.G, getattr(kv, "gv", 1),
                                             t["kc"], t["ks"], km, t["vc"], t["vs"], vm, allowed, slot, f.residual,
                                             rk, rv, kvkernel.CHUNK)
        return out.reshape(B, Hq, 1, D)
    qg = q.view(B, Hkv, Hq // Hkv, D).float() * scaling
    ok_q = allowed  # (B, 1, T)
    if kv.ring:
        W = kv.ring
        n_quant = ((slot + 1 - f.residual) // kv.G * kv.G).clamp_min(0)
        ok_q = allowed & (torch.arange(T, device=q.device) < n_quant)
        tok = slot - (slot - torch.arange(W, device=q.device)) % W  # the token each ring slot holds (the latest)
        ok_r = (tok >= n_quant) & (tok >= 0)
        ok_r = ok_r & allowed.gather(2, tok.clamp_min(0).view(1, 1, W).expand(B, 1, W))  # (B, 1, W)
    s_q = kv.scores(qg)  # (B, Hkv, r, T)
    s_q = s_q.masked_fill(~ok_q[:, :, None, :].expand_as(s_q), NEG)
    if not kv.ring:
        return kv.weighted_values(torch.softmax(s_q, -1)).reshape(B, Hq, 1, D).to(q.dtype)
    rk, rv = kv.t["rk"].float(), kv.t["rv"].float()
    s_r = (qg[:, :, :, None, :] * rk[:, :, None, :, :]).sum(-1)
    s_r = s_r.masked_fill(~ok_r[:, :, None, :].expand_as(s_r), NEG)
    p = torch.softmax(torch.cat([s_q, s_r], -1), -1)
    out = kv.weighted_values(p[..., :T]) + (p[..., T:, None] * rv[:, :, None, :, :]).sum(-2)
    return out.reshape(B, Hq, 1, D).to(q.dtype)


@torch.compiler.assume_constant_result
def rows_on() -> bool:
    """Whether 16-bit linears of few rows on a CPU go through `fewbits.kernels.rows` (decided once per trace)."""
    return rows.enabled()


#: 16-bit dtypes whose CPU matmul torch runs in generic loops on this CPU (`fewbits.kernels.wide16`), read once
#: at import so that a compiled step sees a constant
WIDEN: tuple[torch.dtype, ...] = tuple(d for d in wide16.HALF if not wide16.native_gemm(d))
#: rows up to which a dtype in WIDEN runs as dense_mm tiles (of `rows.DENSE_MAX_ROWS` rows, each reading the 16-bit
#: weight in place): a bf16 SmolLM2 step at batch 16 on an AVX2 EPYC took 332 ms through torch and 295 ms widened
#: (its 135M weights converted to fp32 every step); from here on a GEMM in fp32 converts once per many rows
TILE_MAX_ROWS = 64


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ w.T (+ bias) on a CPU for 16-bit x and w of one dtype, no gradient recorded: up to
    `rows.DENSE_MAX_ROWS[dtype]` rows of x through ``fewbits_rows::dense_mm`` (the weight read in place; the
    operators built, `rows_on`); for a dtype in `WIDEN`, up to `TILE_MAX_ROWS` rows as dense_mm tiles and
    beyond in fp32 rounded once (`wide16.fp32_linear`); else None."""
    if x.device.type != "cpu" or x.dtype != w.dtype or (w.requires_grad and torch.is_grad_enabled()):
        return None
    n, most = x.numel() // x.shape[-1], rows.DENSE_MAX_ROWS.get(w.dtype, 0)
    wide = w.dtype in WIDEN
    if n > most and not (wide and n <= TILE_MAX_ROWS and rows_on()):
        if not wide or n < wide16.MIN_ROWS:
            return None
        return wide16.fp32_linear(x, w, bias)
    if not rows_on():
        return None
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.cat([torch.ops.fewbits_rows.dense_mm(t, w) for t in x2.split(most)]) if n > most else \
        torch.ops.fewbits_rows.dense_mm(x2, w)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def linear16(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mod(x)`; a 16-bit `nn.Linear` with few rows of x on a CPU through `_dense` (the LM head, often the tied
    embedding, and a 16-bit model's projections).  Other modules (the quantised ones run their own kernel):
    the module itself."""
    w = getattr(mod, "weight", None)
    y = _dense(x, w, mod.bias) if type(mod) is nn.Linear and w is not None else None
    return mod(x) if y is None else y


def _fused(fl: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A fused projection's parts; a 16-bit one through `_dense` where it applies."""
    y = _dense(x, fl.weight, fl.bias) if fl.kernel is None else None
    return fl(x) if y is None else tuple(y.split(fl.sizes, dim=-1))


def _qkv(attn: torch.nn.Module, f: LayerFusion | None, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if f is not None and f.qkv is not None:
        return _fused(f.qkv, x)
    return linear16(attn.q_proj, x), linear16(attn.k_proj, x), linear16(attn.v_proj, x)


def _mlp(mlp: torch.nn.Module, f: LayerFusion | None, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP (down(act(gate(x)) * up(x)), as transformers' Llama/Qwen/Gemma MLPs) with gate/up as one
    matmul where they were fused, its projections through `linear16`; another kind of MLP: the module itself."""
    if f is None or f.gate_up is None:
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return mlp(x)
        gate, up = linear16(mlp.gate_proj, x), linear16(mlp.up_proj, x)
    else:
        gate, up = _fused(f.gate_up, x)
    return linear16(mlp.down_proj, mlp.act_fn(gate) * up)


def forward(model: torch.nn.Module, arch: Arch, cache: list[LayerKV], valid: torch.Tensor, ids: torch.Tensor,
            pos: torch.Tensor, slot: torch.Tensor | None = None, length: int | None = None,
            fused: Fused | None = None) -> torch.Tensor:
    """Logits (B, V) of the last position.  ids/pos (B, n).  `slot` None: a prefill of n tokens into slots
    0..n-1 (`valid` already set); else a decode step (n = 1) writing slot `slot` ((1,) long tensor).

    `length` (the tokens held after this step, an int) is given only to an uncompiled step: a quantised
    cache is then read dequantised into 16 bits, as the eager path reads it (`_attend_dense`), instead of
    through the fused reductions over its codes (`_attend_codes`) that only pay off compiled.

    `fused` (`fewbits.decode.fuse.fuse_projections`): q/k/v and gate/up run as one matmul each where fused."""
    inner = model.model
    B, n = ids.shape
    T = valid.shape[1]
    h = inner.embed_tokens(ids)
    ropes = {}
    for key in arch.rope_keys:
        cos, sin = inner.rotary_emb(h, pos, key) if key is not None else inner.rotary_emb(h, pos)
        # stored once a step: inductor otherwise recomputes them inside every layer's rotary kernel
        ropes[key] = (_stored(cos.unsqueeze(1)), _stored(_signed_sin(sin.unsqueeze(1))))
    ar = torch.arange(T, device=ids.device)
    if slot is None:
        qslot = torch.arange(n, device=ids.device).view(1, n, 1)
    else:
        valid.index_fill_(1, slot, True)
        qslot = slot.view(1, 1, 1)
    base = valid[:, None, :] & (ar.view(1, 1, T) <= qslot)  # (B, n, T)
    if slot is None:  # a padding query sees itself: its row stays finite (and is never attended to)
        base = base | (ar.view(1, 1, T) == qslot)
    # the masks stored once a step: inductor otherwise recomputes them inside every layer's kernel, into the
    # operators' buffers (batch 8, 2048 tokens: a step 1.04x faster stored, bf16 and KIVI caches alike)
    base = _stored(base)
    masks: dict[int | None, torch.Tensor] = {None: base}
    Hq, Hkv, D = arch.n_heads, arch.n_kv_heads, arch.head_dim
    fl = fused.layers if fused is not None else [None] * arch.n_layers
    for layer, plan, kv, f in zip(inner.layers[: arch.n_layers], arch.layers, cache, fl, strict=True):
        if plan.window not in masks:
            masks[plan.window] = _stored(base & (qslot - ar.view(1, 1, T) < plan.window))
        allowed = masks[plan.window]
        attn = layer.self_attn
        res = h
        x = layer.input_layernorm(h)
        q, k, v = _qkv(attn, f, x)
        q, k, v = q.view(B, n, Hq, D), k.view(B, n, Hkv, D), v.view(B, n, Hkv, D).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = ropes[plan.rope_key]
        q, k = _stored(_rope(q.transpose(1, 2), cos, sin)), _rope(k.transpose(1, 2), cos, sin)
        if slot is None:
            kv.prefill(k, v, 0)
            kd, vd = kv.dense(n, q.dtype)
            o = _attend_dense(q, kd, vd, allowed[:, :, :n], plan.scaling)
        else:
            kv.step(k, v, slot)
            if length is not None:
                kd, vd = kv.dense(length, q.dtype)
                o = _attend_dense(q, kd, vd, allowed[:, :, :length], plan.scaling)
            else:
                o = _attend_codes(q, kv, allowed, slot, plan.scaling)
        o = linear16(attn.o_proj, o.transpose(1, 2).reshape(B, n, Hq * D))
        if arch.sandwich:
            h = res + layer.post_attention_layernorm(o)
            h = h + layer.post_feedforward_layernorm(_mlp(layer.mlp, f, layer.pre_feedforward_layernorm(h)))
        else:
            h = res + o
            h = h + _mlp(layer.mlp, f, layer.post_attention_layernorm(h))
    logits = linear16(model.lm_head, inner.norm(h[:, -1:]))[:, -1]
    if arch.final_softcap:
        logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
    return logits
