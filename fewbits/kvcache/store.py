"""A preallocated, quantised KV store for one attention layer (independent of any model library).

    store = KVStore(parse_kv_format("int4"), batch=1, n_heads=3, head_dim=64, max_len=4096, dtype=torch.bfloat16)
    store.append(k, v)          # (B, H, n, D) new keys/values: quantised on this write
    K, V = store.read()         # (B, H, T, D) in `dtype`: dequantised + the 16-bit window
    store.nbytes                # exact bytes held for the T tokens written so far

Quantised tokens live in buffers sized for `max_len` tokens, allocated once; the residual window is a
buffer of R + G tokens.  Every write passes through the same path (`append`), at prefill and at every
decode step, for keys and values.
"""

from __future__ import annotations

import torch

from fewbits.kvcache import quant as Q
from fewbits.kvcache.format import KVFormat, parse_kv_format

_FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class KVStore:
    """Keys and values of one layer for a batch of sequences that advance together."""

    def __init__(self, fmt: KVFormat | str, batch: int, n_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 head_dim_v: int | None = None) -> None:
        self.fmt = parse_kv_format(fmt)
        self.dk, self.dv = head_dim, head_dim_v or head_dim
        self.fmt.check_head_dim(self.dk)
        self.fmt.check_head_dim(self.dv)
        if max_len <= 0:
            raise ValueError(f"KV store needs max_len > 0, got {max_len}")
        self.batch, self.heads, self.max_len = batch, n_heads, max_len
        self.dtype, self.device = dtype, torch.device(device)
        self.window_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        self.length = 0  # tokens written
        self.n_quant = 0  # of which stored quantised
        self.n_res = 0  # of which in the 16-bit window
        self._alloc()

    # ------------------------------------------------------------------ storage
    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.batch, self.heads, *shape, dtype=dtype, device=self.device)

    def _alloc(self) -> None:
        f, T = self.fmt, self.max_len
        if f.kind == "float":
            dt = _FLOAT[f.element]
            self.k = {"x": self._empty(T, self.dk, dtype=dt)}
            self.v = {"x": self._empty(T, self.dv, dtype=dt)}
            return
        self.group = f.group if f.kind == "kivi" else 1
        if f.kind in ("fp8", "int8"):
            cdt = torch.int8 if f.kind == "int8" else torch.uint8
            self.k = {"c": self._empty(T, self.dk, dtype=cdt), "s": self._empty(T, 1, dtype=torch.float16)}
            self.v = {"c": self._empty(T, self.dv, dtype=cdt), "s": self._empty(T, 1, dtype=torch.float16)}
        else:
            tg = -(-T // f.group)
            gv = f.value_group(self.dv)
            self.k = {"c": self._empty(T, self.dk * f.bits // 8, dtype=torch.uint8),
                      "s": self._empty(tg, self.dk, dtype=torch.float16),
                      "m": self._empty(tg, self.dk, dtype=torch.float16)}
            self.v = {"c": self._empty(T, self.dv * f.bits // 8, dtype=torch.uint8),
                      "s": self._empty(T, self.dv // gv, dtype=torch.float16),
                      "m": self._empty(T, self.dv // gv, dtype=torch.float16)}
        w = f.residual + self.group
        self.rk = self._empty(w, self.dk, dtype=self.window_dtype)
        self.rv = self._empty(w, self.dv, dtype=self.window_dtype)

    def reset(self) -> None:
        self.length = self.n_quant = self.n_res = 0

    # ------------------------------------------------------------------ writing
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write n new tokens: k (B, H, n, Dk), v (B, H, n, Dv)."""
        B, H, n, _ = k.shape
        if (B, H) != (self.batch, self.heads) or k.shape[-1] != self.dk or v.shape[-1] != self.dv \
                or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"KV store ({self.batch}, {self.heads}, *, {self.dk}/{self.dv}) cannot take keys "
                             f"{tuple(k.shape)} and values {tuple(v.shape)}")
        if self.length + n > self.max_len:
            raise ValueError(f"KV store holds at most {self.max_len} tokens; {self.length} written, "
                             f"{n} more do not fit (format {self.fmt.spec})")
        if self.fmt.kind == "float":
            t0 = self.length
            self.k["x"][:, :, t0:t0 + n] = k
            self.v["x"][:, :, t0:t0 + n] = v
            self.length += n
            return
        pend_k = torch.cat([self.rk[:, :, :self.n_res], k.to(self.window_dtype)], 2)  # (B, H, P, Dk)
        pend_v = torch.cat([self.rv[:, :, :self.n_res], v.to(self.window_dtype)], 2)
        P = pend_k.shape[2]
        n_flush = max(0, (P - self.fmt.residual) // self.group * self.group)
        if n_flush:
            self._write_quantised(pend_k[:, :, :n_flush], pend_v[:, :, :n_flush])
        rest = P - n_flush  # < residual + group
        self.rk[:, :, :rest] = pend_k[:, :, n_flush:]
        self.rv[:, :, :rest] = pend_v[:, :, n_flush:]
        self.n_res = rest
        self.length += n

    def _write_quantised(self, k: torch.Tensor, v: torch.Tensor) -> None:
        f, t0, n = self.fmt, self.n_quant, k.shape[2]
        t1 = t0 + n
        if f.kind in ("fp8", "int8"):
            qfn = Q.quant_fp8_per_token if f.kind == "fp8" else Q.quant_int8_per_token
            for src, dst in ((k, self.k), (v, self.v)):
                c, s = qfn(src)
                dst["c"][:, :, t0:t1] = c
                dst["s"][:, :, t0:t1] = s
        else:
            c, s, m = Q.quant_kivi_keys(k, f.bits, f.group)
            g0, g1 = t0 // f.group, t1 // f.group
            self.k["c"][:, :, t0:t1] = c
            self.k["s"][:, :, g0:g1] = s
            self.k["m"][:, :, g0:g1] = m
            c, s, m = Q.quant_kivi_values(v, f.bits, f.value_group(self.dv))
            self.v["c"][:, :, t0:t1] = c
            self.v["s"][:, :, t0:t1] = s
            self.v["m"][:, :, t0:t1] = m
        self.n_quant = t1

    # ------------------------------------------------------------------ reading
    def _dequantised(self) -> tuple[torch.Tensor, torch.Tensor]:
        f, T, dt = self.fmt, self.n_quant, self.dtype
        if f.kind == "int8":
            return (Q.dequant_int8_per_token(self.k["c"][:, :, :T], self.k["s"][:, :, :T], dt),
                    Q.dequant_int8_per_token(self.v["c"][:, :, :T], self.v["s"][:, :, :T], dt))
        if f.kind == "fp8":
            return (Q.dequant_fp8_per_token(self.k["c"][:, :, :T], self.k["s"][:, :, :T], dt),
                    Q.dequant_fp8_per_token(self.v["c"][:, :, :T], self.v["s"][:, :, :T], dt))
        G = T // f.group
        keys = Q.dequant_kivi_keys(self.k["c"][:, :, :T], self.k["s"][:, :, :G], self.k["m"][:, :, :G],
                                   f.bits, f.group, dt)
        vals = Q.dequant_kivi_values(self.v["c"][:, :, :T], self.v["s"][:, :, :T], self.v["m"][:, :, :T],
                                     f.bits, f.value_group(self.dv), dt)
        return keys, vals

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values written so far, (B, H, T, D), in the store's dtype."""
        if self.fmt.kind == "float":
            T = self.length
            return self.k["x"][:, :, :T].to(self.dtype), self.v["x"][:, :, :T].to(self.dtype)
        keys, vals = self._dequantised() if self.n_quant else (None, None)
        if self.n_res:
            rk = self.rk[:, :, :self.n_res].to(self.dtype)
            rv = self.rv[:, :, :self.n_res].to(self.dtype)
            keys = rk if keys is None else torch.cat([keys, rk], 2)
            vals = rv if vals is None else torch.cat([vals, rv], 2)
        if keys is None:
            empty = torch.zeros(self.batch, self.heads, 0, self.dk, dtype=self.dtype, device=self.device)
            return empty, empty[..., :0].expand(self.batch, self.heads, 0, self.dv)
        return keys, vals

    # ------------------------------------------------------------------ bytes
    @property
    def nbytes(self) -> int:
        """Bytes of the stored representation of the tokens written so far (codes, scales, window)."""
        f = self.fmt
        if f.kind == "float":
            return sum(t[:, :, :self.length].numel() * t.element_size() for t in (self.k["x"], self.v["x"]))
        T, G = self.n_quant, self.n_quant // self.group
        total = 0
        for d in (self.k, self.v):
            for key, t in d.items():
                rows = G if (d is self.k and key in ("s", "m") and f.kind == "kivi") else T
                total += t[:, :, :rows].numel() * t.element_size()
        for r in (self.rk, self.rv):
            total += r[:, :, :self.n_res].numel() * r.element_size()
        return total

    @property
    def allocated_nbytes(self) -> int:
        """Bytes allocated for `max_len` tokens (buffers + window)."""
        ts = list(self.k.values()) + list(self.v.values())
        if self.fmt.kind != "float":
            ts += [self.rk, self.rv]
        return sum(t.numel() * t.element_size() for t in ts)

