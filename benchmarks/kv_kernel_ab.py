"""The KV-cache attention operator of a git ref beside the working tree's, in one process (`fewbits.decode.kvkernel`).

The ref's source (kvkernel.cpp with its per-ISA parts) is built under another operator namespace
(`fewbits_kv_ref`), so both run on the same caches, alternating round by round: a change to the kernel is
measured against the code before it on the same host in the same minutes, and the outputs are compared (the
largest difference; 0 for a change that keeps the arithmetic).  Each round calls `_attend_codes` on 30 layers'
caches in turn (SmolLM2's depth and, by default, heads), so a layer's cache is not in the core's caches when it
is read; `--evict MB` also streams that many MB of other memory before each layer, as a decode step's weights do
(SmolLM2 int4-g64: ~2 MB a layer).  Calls are eager (a Python call around each operator, the same for both).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/kv_kernel_ab.py --ref HEAD~1 --kv int4,int8-r128 \\
        --prompt 512,2048 --batch 1,8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from fewbits.decode import kvkernel
from fewbits.decode.cache import LayerKV, make_cache
from fewbits.decode.step import _attend_codes
from fewbits.kernels import native

LAYERS = 30
REF_NS = "fewbits_kv_ref"


def build_ref(ref: str) -> None:
    """Build git `ref`'s kvkernel source under the namespace `REF_NS` (raises if git or the build fails)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{ref}:{path}"], capture_output=True, text=True, check=True).stdout

    src = kvkernel.PART.sub(lambda m: show(f"fewbits/decode/{m.group(1)}"), show("fewbits/decode/kvkernel.cpp"))
    src = src.replace("TORCH_LIBRARY(fewbits_kv,", f"TORCH_LIBRARY({REF_NS},")
    fakes = {f"{REF_NS}::{op}": kvkernel._fake for op in ("attend_kv", "attend_rows")}
    fakes[f"{REF_NS}::append_kv"] = kvkernel._fake_append
    if not native.build("fewbits_attend_kv_ref", src, fakes, kvkernel.CFLAGS):
        raise SystemExit(f"building {ref}'s kernel failed: {native.why('fewbits_attend_kv_ref')}")
    same = src.replace(REF_NS, "fewbits_kv") == kvkernel._SRC
    print(f"{ref}'s kernel: {'the same source as' if same else 'differs from'} the working tree's")


def caches(kv: str, B: int, heads: tuple[int, int, int], T: int) -> list[LayerKV]:
    """LAYERS layers' caches of `kv` holding T random tokens (a KIVI cache's latest in its 16-bit window)."""
    _, Hkv, D = heads
    g = torch.Generator().manual_seed(T + B)
    layers = make_cache(kv, LAYERS, B, Hkv, D, T + 64, torch.bfloat16, "cpu")
    for layer in layers:
        k, v = (torch.randn(B, Hkv, T, D, generator=g).bfloat16() for _ in range(2))
        layer.prefill(k, v, 0)
    return layers


def runner(layers: list[LayerKV], q: torch.Tensor, T: int, evict_mb: float) -> Callable[[str], list[torch.Tensor]]:
    """A call of every layer's attention at slot T - 1 through the namespace given ("fewbits_kv" or REF_NS)."""
    B = q.shape[0]
    t = layers[0].t
    allowed = torch.zeros(B, 1, t["k" if "k" in t else "kc"].shape[2], dtype=torch.bool)  # every slot of the cache
    allowed[:, :, :T] = True
    slot = torch.tensor([T - 1])
    per = int(evict_mb * 2**20 / 4)
    stream = torch.ones(per * LAYERS) if per else None
    ops = torch.ops.__dict__

    def run(ns: str) -> list[torch.Tensor]:
        own = torch.ops.fewbits_kv  # (resolved once, then held in torch.ops' __dict__)
        ops["fewbits_kv"] = getattr(torch.ops, ns)
        try:
            out = []
            for i, layer in enumerate(layers):
                if stream is not None:
                    stream[i * per:(i + 1) * per].sum()
                out.append(_attend_codes(q, layer, allowed, slot, q.shape[-1] ** -0.5))
            return out
        finally:
            ops["fewbits_kv"] = own

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="git ref whose kernel is the baseline (default HEAD)")
    ap.add_argument("--kv", default="int4,int8-r128,bf16", help="KV formats, comma-separated")
    ap.add_argument("--prompt", default="2048", help="tokens in the cache, comma-separated")
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (SmolLM2's by default)")
    ap.add_argument("--rounds", type=int, default=30, help="alternating rounds (each: every layer once per side)")
    ap.add_argument("--evict", type=float, default=0.0, help="MB of other memory streamed before each layer")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kvkernel.available():
        raise SystemExit(f"the working tree's kernel did not build: {native.why(kvkernel.NAME)}")
    build_ref(args.ref)
    heads = tuple(int(x) for x in args.heads.split(","))
    if len(heads) != 3 or heads[0] % heads[1]:
        raise SystemExit(f"--heads must be Hq,Hkv,D with Hq a multiple of Hkv, got {args.heads}")
    print(f"threads {torch.get_num_threads()}, heads {args.heads}, {LAYERS} layers a round, evict {args.evict} MB "
          f"a layer; microseconds a layer")
    print(f"{'kv':>12} {'batch':>5} {'tokens':>6} {'ref best':>9} {'ref med':>8} {'new best':>9} {'new med':>8} "
          f"{'best x':>7} {'med x':>6} {'max |diff|':>10}")
    for kv in args.kv.split(","):
        for B in (int(b) for b in args.batch.split(",")):
            for T in (int(t) for t in args.prompt.split(",")):
                q = torch.randn(B, heads[0], 1, heads[2], generator=torch.Generator().manual_seed(1)).bfloat16()
                run = runner(caches(kv, B, heads, T), q, T, args.evict)
                diff = max((a.float() - b.float()).abs().max().item()
                           for a, b in zip(run(REF_NS), run("fewbits_kv"), strict=True))
                times: dict[str, list[float]] = {REF_NS: [], "fewbits_kv": []}
                for r in range(args.rounds):
                    for ns in (list(times) if r % 2 == 0 else list(times)[::-1]):
                        t0 = time.perf_counter()
                        run(ns)
                        times[ns].append((time.perf_counter() - t0) / LAYERS * 1e6)
                (rb, rm), (nb, nm) = ((min(t), statistics.median(t)) for t in times.values())
                print(f"{kv:>12} {B:>5} {T:>6} {rb:9.1f} {rm:8.1f} {nb:9.1f} {nm:8.1f} {rb / nb:6.3f}x "
                      f"{rm / nm:5.3f}x {diff:10.2e}", flush=True)


if __name__ == "__main__":
    main()
