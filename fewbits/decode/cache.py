"""A preallocated KV cache for the fixed-graph decode step, in every fewbits KV format.

Every tensor is allocated once for `max_len` slots; a decode step writes slot `t` (a tensor, so the step
is one graph for every t) and attends over all slots under a mask.  Semantics are those of `KVStore`
(`fewbits.kvcache.store`), token for token: with a residual window of R tokens and groups of G tokens
(KIVI; G = 1 for int8 / fp8), the first (len - R) // G * G tokens are stored quantised, the others in a
16-bit ring of R + G slots; a group is quantised once, from the ring, when it leaves the window.  In the
graph that flush happens at every step under a condition (`torch.where`), so there are no branches.

Attention reads the stored codes, not a dequantised copy: the scale (and KIVI's minimum) is applied inside
the score and value reductions, which inductor fuses into one pass over the codes, so a step reads the
cache's own bytes (`attend_codes`).  Outside a compiled graph (prefill, an eager fallback) the codes are
dequantised with `fewbits.kvcache.quant`'s functions and a plain matmul runs (`attend_dense`).
"""

from __future__ import annotations

import torch

from fewbits.formats.kvformat import quantized_tokens
from fewbits.kvcache import quant as Q
from fewbits.kvcache.format import KVFormat, parse_kv_format

_FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEG = -1e30  # finite "minus infinity": a fully masked row (a padded query) stays NaN-free


class LayerKV:
    """One layer's keys and values: quantised slots (or 16-bit ones), a 16-bit ring, their scales."""

    def __init__(self, fmt: KVFormat, batch: int, heads: int, dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        z = lambda *s, dt: torch.zeros(batch, heads, *s, dtype=dt, device=device)  # noqa: E731
        T = max_len
        self.t: dict[str, torch.Tensor] = {}
        if fmt.kind == "float":
            self.t = {"k": z(T, dim, dt=_FLOAT[fmt.element]), "v": z(T, dim, dt=_FLOAT[fmt.element])}
            self.ring = 0
            return
        self.G = fmt.group if fmt.kind == "kivi" else 1
        if fmt.kind in ("int8", "fp8"):
            cdt = torch.int8 if fmt.kind == "int8" else torch.uint8
            for n in "kv":
                self.t[f"{n}c"], self.t[f"{n}s"] = z(T, dim, dt=cdt), z(T, 1, dt=torch.float16)
        else:
            self.gv = fmt.value_group(dim)
            nb = dim * fmt.bits // 8
            self.t.update(kc=z(T, nb, dt=torch.uint8), ks=z(T // self.G, dim, dt=torch.float16),
                          km=z(T // self.G, dim, dt=torch.float16), vc=z(T, nb, dt=torch.uint8),
                          vs=z(T, dim // self.gv, dt=torch.float16), vm=z(T, dim // self.gv, dt=torch.float16))
        self.ring = fmt.residual + self.G if (fmt.residual or self.G > 1) else 0
        # keys and values pass through 16 bits before quantising, as `KVStore`'s window holds them
        self.wdt = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if self.ring:
            self.t["rk"], self.t["rv"] = z(self.ring, dim, dt=self.wdt), z(self.ring, dim, dt=self.wdt)

    # ------------------------------------------------------------------ quantising
    def _quantise(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes and scales of whole tokens (KIVI: whole groups), as `KVStore` computes them."""
        f = self.fmt
        if f.kind in ("int8", "fp8"):
            fn = Q.quant_int8_per_token if f.kind == "int8" else Q.quant_fp8_per_token
            (kc, ks), (vc, vs) = fn(k), fn(v)
            return {"kc": kc, "ks": ks, "vc": vc, "vs": vs}
        kc, ks, km = Q.quant_kivi_keys(k, f.bits, self.G)
        vc, vs, vm = Q.quant_kivi_values(v, f.bits, self.gv)
        return {"kc": kc, "ks": ks, "km": km, "vc": vc, "vs": vs, "vm": vm}

    def _store(self, q: dict[str, torch.Tensor], slots: torch.Tensor, flush: torch.Tensor | None = None) -> None:
        """Write quantised tokens at token `slots` (KIVI key scales at their groups); with `flush` (a bool
        tensor) only where it is true (the old values are written back elsewhere)."""
        groups = slots[:: self.G] // self.G
        for name, val in q.items():
            idx = groups if name in ("ks", "km") else slots
            buf = self.t[name]
            if flush is not None:
                val = torch.where(flush, val, buf.index_select(2, idx))
            buf.index_copy_(2, idx, val.to(buf.dtype))

    # ------------------------------------------------------------------ writing
    def prefill(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write n tokens at slots start..start+n-1 of an empty cache (start = 0) with Python ints."""
        n = k.shape[2]
        if self.fmt.kind == "float":
            self.t["k"][:, :, start:start + n] = k
            self.t["v"][:, :, start:start + n] = v
            return
        k, v = k.to(self.wdt), v.to(self.wdt)
        nq = int(quantized_tokens(start + n, self.fmt.residual, self.G))
        if nq:
            self._store(self._quantise(k[:, :, :nq], v[:, :, :nq]), torch.arange(nq, device=k.device))
        for s in range(nq, n):
            self.t["rk"][:, :, s % self.ring] = k[:, :, s]
            self.t["rv"][:, :, s % self.ring] = v[:, :, s]

    def step(self, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        """Write one token (k, v: (B, H, 1, D)) at slot `slot` ((1,) long), flushing a group that leaves the
        window: all tensor operations, the same for every slot."""
        if self.fmt.kind == "float":
            self.t["k"].index_copy_(2, slot, k.to(self.t["k"].dtype))
            self.t["v"].index_copy_(2, slot, v.to(self.t["v"].dtype))
            return
        if not self.ring:
            self._store(self._quantise(k.to(self.wdt), v.to(self.wdt)), slot)
            return
        R, G, W = self.fmt.residual, self.G, self.ring
        self.t["rk"].index_copy_(2, slot % W, k.to(self.t["rk"].dtype))
        self.t["rv"].index_copy_(2, slot % W, v.to(self.t["rv"].dtype))
        length = slot + 1
        flush = ((length - R) % G == 0) & (length - R >= G)  # a group just left the window
        g0 = (length - R - G).clamp_min(0)
        slots = g0 + torch.arange(G, device=slot.device)
        ring_idx = slots % W
        q = self._quantise(self.t["rk"].index_select(2, ring_idx), self.t["rv"].index_select(2, ring_idx))
        self._store(q, slots, flush)

    # ------------------------------------------------------------------ reading
    def quantised_dense(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots 0..n-1 dequantised with `fewbits.kvcache.quant` (what `KVStore.read` returns)."""
        t, f = self.t, self.fmt
        if f.kind == "int8":
            return (Q.dequant_int8_per_token(t["kc"][:, :, :n], t["ks"][:, :, :n], dtype),
                    Q.dequant_int8_per_token(t["vc"][:, :, :n], t["vs"][:, :, :n], dtype))
        if f.kind == "fp8":
            return (Q.dequant_fp8_per_token(t["kc"][:, :, :n], t["ks"][:, :, :n], dtype),
                    Q.dequant_fp8_per_token(t["vc"][:, :, :n], t["vs"][:, :, :n], dtype))
        g = n // self.G
        return (Q.dequant_kivi_keys(t["kc"][:, :, :n], t["ks"][:, :, :g], t["km"][:, :, :g], f.bits, self.G, dtype),
                Q.dequant_kivi_values(t["vc"][:, :, :n], t["vs"][:, :, :n], t["vm"][:, :, :n], f.bits, self.gv,
                                      dtype))

    def dense(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots 0..length-1 as 16-bit keys and values (prefill, eager steps)."""
        if self.fmt.kind == "float":
            return self.t["k"][:, :, :length].to(dtype), self.t["v"][:, :, :length].to(dtype)
        nq = int(quantized_tokens(length, self.fmt.residual, self.G)) if self.ring else length
        ks, vs = self.quantised_dense(nq, dtype) if nq else ([], [])
        ks, vs = [ks] if nq else [], [vs] if nq else []
        if length > nq:
            idx = torch.arange(nq, length, device=self.t["rk"].device) % self.ring
            ks.append(self.t["rk"].index_select(2, idx).to(dtype))
            vs.append(self.t["rv"].index_select(2, idx).to(dtype))
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def code_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots' keys and values as fp32 expressions of the codes (B, H, T, D): in a compiled graph they
        are fused into the reductions that use them, never stored.  They are the values `quantised_dense`
        reads (dequantised in the model's dtype, with its roundings), so the compiled step attends over
        the very keys and values the eager path does."""
        t, f = self.t, self.fmt
        if f.kind == "float":  # one fused pass over the 16-bit cache too (no GQA copy of K and V, no mask tensor)
            return t["k"].float(), t["v"].float()
        if f.kind == "int8":
            return (Q.dequant_int8_per_token(t["kc"], t["ks"], self.dtype).float(),
                    Q.dequant_int8_per_token(t["vc"], t["vs"], self.dtype).float())
        if f.kind == "fp8":
            return (Q.dequant_fp8_per_token(t["kc"], t["ks"], self.dtype).float(),
                    Q.dequant_fp8_per_token(t["vc"], t["vs"], self.dtype).float())
        return (Q.dequant_kivi_keys(t["kc"], t["ks"], t["km"], f.bits, self.G, self.dtype).float(),
                Q.dequant_kivi_values(t["vc"], t["vs"], t["vm"], f.bits, self.gv, self.dtype).float())


def make_cache(fmt: KVFormat | str, n_layers: int, batch: int, heads: int, dim: int, max_len: int,
               dtype: torch.dtype, device: torch.device | str) -> list[LayerKV]:
    """One `LayerKV` per layer; `max_len` is rounded up to whole KIVI groups."""
    f = parse_kv_format(fmt)
    f.check_head_dim(dim)
    if f.kind == "kivi":
        max_len = -(-max_len // f.group) * f.group
    return [LayerKV(f, batch, heads, dim, max_len, dtype, torch.device(device)) for _ in range(n_layers)]
