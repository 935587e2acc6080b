"""A preallocated KV cache for the fixed-graph decode step, in every fewbits KV format.

Every tensor is allocated once for `max_len` slots; a decode step writes slot `t` (a tensor, so the step
is one graph for every t) and attends over all slots under a mask.  Semantics are those of `KVStore`
(`fewbits.kvcache.store`), token for token: with a residual window of R tokens and groups of G tokens
(KIVI; G = 1 for int8 / fp8), the first (len - R) // G * G tokens are stored quantised, the others in a
16-bit ring of R + G slots; a group is quantised once, from the ring, when it leaves the window.  On a CPU
with the C++ operators built (`fewbits.decode.kvkernel`), a decode step's write is one operator
(`fewbits_kv::append_kv`) that mutates the cache in place and quantises a group only at the step that
completes it (a branch in C++), with `fewbits.kvcache.quant`'s rounding; a compiled step holds one opaque node
per layer for it.  A cache without a window (int8, fp8) quantises each token in tensor operations that inductor
fuses into the step's kernels (cheaper than an operator call).  Otherwise (a GPU, no compiler,
``FEWBITS_KV_APPEND=torch``) a windowed cache's step is written in tensor operations too: the flush is computed
at every step and kept under a condition (`torch.where`), so the graph has no branches.

Attention reads the stored codes, not a dequantised copy: on a CPU int8 and KIVI caches go through one C++
operator (`fewbits.decode.kvkernel`); otherwise `LayerKV.scores` / `weighted_values` fold the scales and
minima out of the score and value reductions, which inductor fuses into passes over the codes, so a step
reads the cache's own bytes (`step._attend_codes`).  Outside a compiled graph (prefill, an eager fallback) the codes are
dequantised with `fewbits.kvcache.quant`'s functions and a plain matmul runs (`attend_dense`).
"""

from __future__ import annotations

import os

import torch

from fewbits.decode import kvkernel
from fewbits.formats.kvformat import quantized_tokens
from fewbits.kvcache import quant as Q
from fewbits.kvcache.format import KVFormat, parse_kv_format

_FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEG = -1e30  # finite "minus infinity": a fully masked row (a padded query) stays NaN-free
#: decode steps write windowed int8 / KIVI caches through `fewbits_kv::append_kv` where it is built (read when a
#: cache is made); ``FEWBITS_KV_APPEND=torch`` keeps the tensor-operation write (`LayerKV.step`'s flush under
#: torch.where); ``FEWBITS_KV_APPEND=always`` writes an int8 cache without a window through the operator too (the
#: write before the fused one, for A/B measurements: `benchmarks/bench_compiled.py` kv specs ending in ":append")
NATIVE_APPEND = os.environ.get("FEWBITS_KV_APPEND", "native") != "torch"
APPEND_WITHOUT_WINDOW = os.environ.get("FEWBITS_KV_APPEND", "native") == "always"
#: ``FEWBITS_KV_ATTEND=torch`` keeps the inductor-fused reductions for a decode step's attention (before/after
#: measurements of `fewbits.decode.kvkernel`'s operators)
NATIVE_ATTEND = os.environ.get("FEWBITS_KV_ATTEND", "native") != "torch"


def native_attention(fmt: KVFormat, device: torch.device | str) -> bool:
    """Whether a step's attention over this cache runs through the hand-written operators
    (`fewbits.decode.kvkernel`, CPU), which read slots up to the query's own only; else inductor's reductions read
    every preallocated slot.  Decided outside any graph."""
    return (fmt.kind in ("int8", "kivi", "float") or (fmt.kind == "fp8" and not fmt.residual)) and \
        torch.device(device).type == "cpu" and NATIVE_ATTEND and kvkernel.available()


class LayerKV:
    """One layer's keys and values: quantised slots (or 16-bit ones), a 16-bit ring, their scales."""

    def __init__(self, fmt: KVFormat, batch: int, heads: int, dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        self.kernel = native_attention(fmt, device)
        z = lambda *s, dt: torch.zeros(batch, heads, *s, dtype=dt, device=device)  # noqa: E731
        T = max_len
        self.native_append = False
        self.t: dict[str, torch.Tensor] = {}
        if fmt.kind == "float":
            self.t = {"k": z(T, dim, dt=_FLOAT[fmt.element]), "v": z(T, dim, dt=_FLOAT[fmt.element])}
            self.ring = 0
            return
        # decode steps write through `fewbits_kv::append_kv` where tokens leave a 16-bit window (KIVI, int8-rN): it
        # quantises a group only at the step that completes it.  A cache without a window (int8, fp8) quantises each
        # token in tensor operations, which inductor fuses into the step's own kernels: one layer's compiled write
        # took ~8 us against 11.5-13 through the operator (an `append_kv` call on an int8 token costs ~6.5 us in a
        # compiled graph, its small work included), ~0.1 ms of a 30-layer step; whole steps (`bench_compiled.py kv --kv
        # bf16,int8,int8:append`) differ by less than the host's noise (+-5%)
        by_operator = fmt.kind == "kivi" or (fmt.kind == "int8" and (fmt.residual > 0 or APPEND_WITHOUT_WINDOW))
        self.native_append = self.kernel and NATIVE_APPEND and by_operator
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
        # `append_kv`'s arguments for what this format lacks (no window, int8's minima): distinct empty tensors
        self._absent = [torch.empty(0, dtype=dt, device=device) for dt in (self.wdt, self.wdt, torch.float16,
                                                                           torch.float16)]

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
        if self.native_append:
            t, (no_rk, no_rv, no_km, no_vm) = self.t, self._absent
            gv = getattr(self, "gv", 1)
            torch.ops.fewbits_kv.append_kv(k.to(self.wdt), v.to(self.wdt), slot, self.fmt.bits, self.G, gv,
                                           self.fmt.residual, t.get("rk", no_rk), t.get("rv", no_rv), t["kc"],
                                           t["ks"], t.get("km", no_km), t["vc"], t["vs"], t.get("vm", no_vm))
            return
        if not self.ring:  # int8 / fp8 per token: the scale stored first, the codes divided by the stored value
            scale, codes = ((Q.int8_token_scale, Q.int8_codes) if self.fmt.kind == "int8"
                            else (Q.fp8_token_scale, Q.fp8_codes))
            for x, cn, sn in ((k, "kc", "ks"), (v, "vc", "vs")):
                xf = x.to(self.wdt).float()
                self.t[sn].index_copy_(2, slot, scale(xf))
                # (read back: fused into one kernel with its store, inductor divides by the fp32 value the fp16
                # scale rounds, and ~1% of the codes differed from the quantiser's by one)
                self.t[cn].index_copy_(2, slot, codes(xf, self.t[sn].index_select(2, slot)))
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

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """q . key for every slot: q (B, Hkv, r, D) fp32 (r query heads share a KV head) -> (B, Hkv, r, T).

        The scale and minimum are folded out of the reduction over D so its inner loop is a plain product
        of the query with the codes: per-token scales multiply the finished dot product (s_t * (q . c_t));
        KIVI's per-channel key scales multiply the query once per group of G tokens (G x D products, small)
        and its minimum becomes one bias per group (sum_d q_d m_{g,d}).  4- and 2-bit codes are read one
        byte at a time, each of its codes against its own slice of the query (no unpacked copy, no index
        arithmetic in the loop)."""
        t, f = self.t, self.fmt
        B, H, r, D = q.shape
        if f.kind == "float":
            return (q[:, :, :, None, :] * t["k"][:, :, None].float()).sum(-1)
        if f.kind in ("int8", "fp8"):
            if f.kind == "int8":
                c, s = t["kc"].float(), t["ks"].float()
            else:
                c, s = Q.e4m3_as_bf16_bits(t["kc"]).float(), t["ks"].float() * 2.0**120
            return (q[:, :, :, None, :] * c[:, :, None]).sum(-1) * s.view(B, H, 1, -1)
        T, G, b = t["kc"].shape[2], self.G, f.bits
        per, nb = 8 // b, D * b // 8
        qs = q[:, :, :, None, :] * t["ks"][:, :, None].float()  # (B, H, r, T/G, D): the query scaled per group
        bias = (q[:, :, :, None, :] * t["km"][:, :, None].float()).sum(-1)  # (B, H, r, T/G)
        qs = qs.view(B, H, r, T // G, 1, nb, per)
        codes = t["kc"].view(B, H, 1, T // G, G, nb)
        acc = None
        for j in range(per):  # code j of each byte is channel byte * per + j
            cj = ((codes >> (b * j)) & ((1 << b) - 1)) if j else codes & ((1 << b) - 1)
            term = cj.float() * qs[..., j]
            acc = term if acc is None else acc + term
        return (acc.sum(-1) + bias[..., None]).view(B, H, r, T)

    def weighted_values(self, p: torch.Tensor) -> torch.Tensor:
        """sum_t p_t value_t: p (B, Hkv, r, T) fp32 -> (B, Hkv, r, D).

        Per-token scales go into the weights once (p_t s_t), and KIVI's per-token minima become one sum
        (sum_t p_t s_t m_t), so the reduction over tokens multiplies the weights with the raw codes."""
        t, f = self.t, self.fmt
        B, H, r, T = p.shape
        D = self.dim
        if f.kind == "float":
            return (p[..., None] * t["v"][:, :, None].float()).sum(-2)
        if f.kind in ("int8", "fp8"):
            if f.kind == "int8":
                c, s = t["vc"].float(), t["vs"].float()
            else:
                c, s = Q.e4m3_as_bf16_bits(t["vc"]).float(), t["vs"].float() * 2.0**120
            ps = p * s.view(B, H, 1, T)
            return (ps[..., None] * c[:, :, None]).sum(-2)
        b, gv = f.bits, self.gv
        per, nb, ng = 8 // b, D * b // 8, D // gv
        ps = p[..., None] * t["vs"][:, :, None].float()  # (B, H, r, T, D/gv)
        bias = (p[..., None] * t["vm"][:, :, None].float()).sum(-2)  # (B, H, r, D/gv)
        # the weight of channel d = byte * per + j is ps[..., d // gv]
        psd = ps[..., None].expand(B, H, r, T, ng, gv).reshape(B, H, r, T, nb, per)
        codes = t["vc"][:, :, None]  # (B, H, 1, T, nb)
        outs = []
        for j in range(per):
            cj = ((codes >> (b * j)) & ((1 << b) - 1)) if j else codes & ((1 << b) - 1)
            outs.append((cj.float() * psd[..., j]).sum(-2))  # (B, H, r, nb)
        out = torch.stack(outs, -1).view(B, H, r, D)
        return out + bias[..., None].expand(B, H, r, ng, gv).reshape(B, H, r, D)


def make_cache(fmt: KVFormat | str, n_layers: int, batch: int, heads: int, dim: int, max_len: int,
               dtype: torch.dtype, device: torch.device | str) -> list[LayerKV]:
    """One `LayerKV` per layer; `max_len` is rounded up to whole KIVI groups."""
    f = parse_kv_format(fmt)
    f.check_head_dim(dim)
    if f.kind == "kivi":
        max_len = -(-max_len // f.group) * f.group
    return [LayerKV(f, batch, heads, dim, max_len, dtype, torch.device(device)) for _ in range(n_layers)]
