"""KV-cache formats: what each cached key/value costs in bytes, and how many tokens fit in a budget.

Pure Python (no torch): the cost model counts a cache's bytes with the same code as the store
(`fewbits.kvcache.format` re-exports this module).

Spec strings:
    bf16 | fp16 | fp32          the unquantised cache
    fp8-e4m3[-r{R}]             E4M3 codes, one fp16 scale per token and head (amax / 448)
    int8[-r{R}]                 symmetric int8 codes, one fp16 scale per token and head (amax / 127)
    int4 | int2 [-g{G}][-r{R}]  KIVI (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization
                                for KV cache", sec. 3.2-3.3): keys per channel over groups of G tokens,
                                values per token over groups of G channels, min-max (fp16 scale and fp16
                                minimum per group); the R most recent tokens stay in 16-bit.
                                Defaults G = 32, R = 128 as in the paper.

Cost-model spellings: `KVFormat.full_spec` always writes the residual (and the KIVI group), e.g.
``int4-g32-r128``, ``int8-r0``, ``fp8-e4m3-r0``; those strings are not weight formats, so `fewbits plan
--kv` and `fewbits.cost.plan` read them as these caches (a bare ``int4`` there stays the plain 4-bit
weight-style figure).

Every write goes through the quantiser: tokens older than the residual window are quantised as soon
as a whole group of them is complete (KIVI keeps between R and R+G-1 tokens in 16-bit), at prefill
and at every decode step alike; keys and values are treated the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fewbits.formats.format import Format, FormatError, parse_format

FLOAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SCALE_BYTES = 2  # fp16 scales and minima


def quantized_tokens(tokens, residual, block):  # noqa: ANN001, ANN201 - ints or numpy arrays
    """Tokens stored quantised after `tokens` writes to a cache that keeps the `residual` most recent
    tokens in 16 bits and quantises older ones `block` at a time: (tokens - R) // G * G, at least 0.  The
    other tokens (between R and R + G - 1 once more than R were written) sit in the 16-bit window.
    Elementwise on numpy arrays, so the cost model's sweeps use the very rule the store follows."""
    q = (tokens - residual) // block * block
    return q * (q > 0)


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache format.  kind: "float", "fp8", "int8" or "kivi"."""

    kind: str
    bits: int
    group: int = 1  # tokens per key scale / channels per value scale (KIVI); 1 = per token
    residual: int = 0  # most recent tokens kept at 16 bits
    element: str = "bf16"  # float name (float kinds) or "e4m3"

    @property
    def spec(self) -> str:
        if self.kind == "float":
            return self.element
        base = {"fp8": "fp8-e4m3", "int8": "int8", "kivi": f"int{self.bits}"}[self.kind]
        parts = [base]
        if self.kind == "kivi" and self.group != 32:
            parts.append(f"g{self.group}")
        if self.residual != (128 if self.kind == "kivi" else 0):
            parts.append(f"r{self.residual}")
        return "-".join(parts)

    def __str__(self) -> str:
        return self.spec

    @property
    def is_quantized(self) -> bool:
        return self.kind != "float"

    def cost_format(self, head_dim: int) -> Format:
        """A weight `Format` with the same asymptotic bits per cached value, for the cost model.

        fp8/int8: head_dim values share one fp16 scale -> ``int8-g{head_dim}`` / ``fp8-e4m3-g{head_dim}-sfp16``.
        KIVI: every G values carry an fp16 scale and an fp16 minimum (32 bits) -> ``int{b}-g{G}-sfp32``,
        which has exactly b + 32/G bits per value (keys group over tokens, values over channels: the
        count is the same).  The 16-bit residual window is not included (it is amortised away).
        """
        if self.kind == "float":
            return parse_format(self.element)
        if self.kind == "fp8":
            return parse_format(f"fp8-e4m3-g{head_dim}-sfp16")
        if self.kind == "int8":
            return parse_format(f"int8-g{head_dim}")
        return parse_format(f"int{self.bits}-g{self.value_group(head_dim)}-sfp32")

    @property
    def full_spec(self) -> str:
        """The spec with every option written out (``int4-g32-r128``, ``int8-r0``); parses back to `self`."""
        if self.kind == "float":
            return self.element
        if self.kind == "kivi":
            return f"int{self.bits}-g{self.group}-r{self.residual}"
        return f"{'fp8-e4m3' if self.kind == 'fp8' else 'int8'}-r{self.residual}"

    # ------------------------------------------------------------------ sizes
    @property
    def block(self) -> int:
        """Tokens quantised together when they leave the window (KIVI: the key group; else 1)."""
        return self.group if self.kind == "kivi" else 1

    def quantized_tokens(self, tokens):  # noqa: ANN001, ANN201 - int or numpy array in, same out
        """Tokens stored quantised after `tokens` writes (see `quantized_tokens`)."""
        return quantized_tokens(tokens, self.residual, self.block)

    def token_bytes(self, head_dim: int, window_bytes: int = 2) -> tuple[float, float]:
        """(bytes of one quantised token, bytes of one window token): keys + values of one head.

        fp8/int8: head_dim one-byte codes + one fp16 scale each for keys and values.  KIVI: b-bit codes,
        an fp16 (scale, minimum) per channel per G tokens for keys and per G channels of a token for
        values (the key part is exact for whole groups, which is all a store ever holds)."""
        if self.kind == "float":
            b = 2.0 * head_dim * FLOAT_BYTES[self.element]
            return b, b
        window = 2.0 * head_dim * window_bytes
        if self.kind in ("fp8", "int8"):
            return 2.0 * (head_dim + SCALE_BYTES), window
        codes = 2.0 * (head_dim * self.bits // 8)
        groups = head_dim / self.group + head_dim // self.value_group(head_dim)  # (scale, min) pairs
        return codes + 2 * SCALE_BYTES * groups, window

    def head_bytes(self, tokens: int, head_dim: int, window_bytes: int = 2) -> int:
        """Exact bytes of keys + values of one head of one layer holding `tokens` tokens."""
        tq = self.quantized_tokens(tokens)
        q, w = self.token_bytes(head_dim, window_bytes)
        return round(tq * q + (tokens - tq) * w)

    def value_group(self, head_dim: int) -> int:
        return min(self.group, head_dim)

    def nbytes(self, tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, batch: int = 1,
               window_bytes: int = 2) -> int:
        """Exact cache bytes for `batch` sequences of `tokens` tokens (what `KVStore.nbytes` reports)."""
        return batch * n_layers * n_kv_heads * self.head_bytes(tokens, head_dim, window_bytes)

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int) -> float:
        """Asymptotic bytes per token of context (the residual window amortised away)."""
        big = 1 << 20
        return (self.nbytes(2 * big, n_layers, n_kv_heads, head_dim)
                - self.nbytes(big, n_layers, n_kv_heads, head_dim)) / big

    def max_context(self, budget_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int, batch: int = 1) -> int:
        """The largest context (tokens per sequence) whose cache fits in `budget_bytes`."""
        if budget_bytes < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget_bytes}")

        def fits(t: int) -> bool:
            return self.nbytes(t, n_layers, n_kv_heads, head_dim, batch) <= budget_bytes

        lo, hi = 0, 1
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # bytes grow monotonically with tokens
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def check_head_dim(self, head_dim: int) -> None:
        if self.kind == "kivi":
            if head_dim * self.bits % 8:
                raise FormatError(f"KV format {self.spec}: head dim {head_dim} does not pack into whole bytes")
            if head_dim % self.value_group(head_dim):
                raise FormatError(f"KV format {self.spec}: head dim {head_dim} is not divisible by the value "
                                  f"group {self.value_group(head_dim)}")


_KV = re.compile(r"^(bf16|fp16|fp32|fp8-e4m3|int8|int4|int2)((?:-[gr]\d+)*)$")

KV_SPECS = ("bf16", "fp8-e4m3", "int8", "int4", "int2")


def parse_kv_format(spec: str | KVFormat) -> KVFormat:
    """Parse a KV-cache spec such as ``fp8-e4m3``, ``int8``, ``int4``, ``int2-g64-r64``."""
    if isinstance(spec, KVFormat):
        return spec
    s = str(spec).strip().lower()
    m = _KV.match(s)
    if not m:
        raise FormatError(f"unknown KV-cache format {spec!r}; one of {', '.join(KV_SPECS)} "
                          "(int4/int2 take -g{{group}} and -r{{residual}}, e.g. int2-g32-r128)")
    head, rest = m.group(1), m.group(2)
    opts = {}
    for part in [p for p in rest.split("-") if p]:
        if part[0] in opts:
            raise FormatError(f"KV-cache format {spec!r}: suffix -{part[0]} given twice")
        opts[part[0]] = int(part[1:])
    if head in FLOAT_BYTES:
        if opts:
            raise FormatError(f"KV-cache format {spec!r}: {head} takes no suffix")
        return KVFormat("float", FLOAT_BYTES[head] * 8, element=head)
    if head in ("fp8-e4m3", "int8"):
        if "g" in opts:
            raise FormatError(f"KV-cache format {spec!r}: {head} scales each token and head; no -g")
        kind = "fp8" if head == "fp8-e4m3" else "int8"
        return KVFormat(kind, 8, 1, opts.get("r", 0), "e4m3" if kind == "fp8" else "int")
    group, residual = opts.get("g", 32), opts.get("r", 128)
    if group <= 0 or residual < 0:
        raise FormatError(f"KV-cache format {spec!r}: group must be > 0 and residual >= 0")
    return KVFormat("kivi", int(head[3:]), group, residual, "int")
