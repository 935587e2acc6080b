"""Decode with its weights and cache in 4 KiB pages against the same tensors in transparent huge pages
(`fewbits.decode.pages`), rows alternating round by round in one process: the same tensor objects moved back
and forth between the two kinds of mapping (`place(..., again=True)`), so the compiled step, the values and
the tokens are the same in both arms.  Threads pinned (default 2).

    PYTHONPATH=. python benchmarks/bench_hugepages.py [--model smollm2-135m,gemma3-270m] [--weights bf16,int4-g32+a8]
        [--random-weights] [--batch 1] [--steps 32] [--rounds 6] [--gemv 262144x640]

Rows: per model and format, the compiled step's fastest and median time in each arm and the median's ratio
(4 KiB / huge: above 1 the huge pages are faster), with the bytes placed and how many of them the kernel backed
with huge pages (/proc/self/smaps); then `fewbits_rows::dense_mm` (a one-row bf16 GEMV, --gemv N x K: Gemma-3's
LM head by default) over one weight in each arm, as GB/s.  "+a8" after a format lets the kernels round the
activations to int8 (`cpu_q4_a8`), as in bench_compiled.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fewbits.decode import pages


def _arms(roots: list[object], run, rounds: int) -> dict[str, list[float]]:  # noqa: ANN001
    """Per arm ("4k", "huge"), the samples of `run()` (a list of seconds each), the arms alternating in order
    round by round."""
    out: dict[str, list[float]] = {"4k": [], "huge": []}
    backed = 0
    for r in range(rounds):
        for arm in ("4k", "huge") if r % 2 == 0 else ("huge", "4k"):
            got = pages.place(roots, huge=arm == "huge", again=True)
            if got.why_not:
                raise SystemExit(f"cannot place the tensors: {got.why_not}")
            if arm == "huge":
                backed = got.huge_bytes()
            out[arm] += run()
    out["placed"] = [got.nbytes, backed]
    return out


def _row(label: str, arms: dict[str, list[float]], unit: str = "ms") -> str:
    a, b = arms["4k"], arms["huge"]
    placed, backed = arms["placed"]
    return (f"{label:<34} {min(a) * 1e3:8.2f} {statistics.median(a) * 1e3:8.2f} {min(b) * 1e3:8.2f} "
            f"{statistics.median(b) * 1e3:8.2f} {statistics.median(a) / statistics.median(b):7.3f}x "
            f"{placed / 1e6:8.1f} {backed / 1e6:8.1f}")


def _decode_arms(name: str, w: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """The compiled step of model `name` in format `w`, timed in both arms."""
    from fewbits.bench.decode import load_quantized, split_activations
    from fewbits.decode.generate import decoder_for, generate_static

    spec, act = split_activations(w)
    model = load_quantized(name, spec, activations=act, random_weights=args.random_weights)[0]
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    first = generate_static(model, ids, args.steps + 1)  # compiles (or loads) the step, places its tensors
    if first.path != "compiled":
        raise SystemExit(f"{name} {w}: the step ran eagerly ({first.eager_reason})")
    dec = decoder_for(model, "bf16", args.batch, args.prompt + args.steps + 1)

    def run() -> list[float]:
        res = generate_static(model, ids, args.steps + 1)
        if not torch.equal(res.tokens, first.tokens):
            raise SystemExit("the tokens changed with the placement")
        return res.decode_step_s

    return _arms([model, dec.fused, dec.cache], run, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--weights", default="bf16,int4-g32+a8")
    ap.add_argument("--random-weights", action="store_true",
                    help="build the models from their architecture alone (any preset, e.g. llama-3.2-1b)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps a round and arm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemv", default="262144x640", help="N x K of the bf16 GEMV row ('' to skip)")
    args = ap.parse_args()
    # the compiled step must read the tensors where each arm puts them, not through the block of the first
    # placement by offsets (`Q4Kernel.bind`, which the decoder does by default)
    os.environ["FEWBITS_BIND"] = "0"
    torch.set_num_threads(args.threads)
    why = pages.why_not_huge()
    if why:
        raise SystemExit(f"no huge pages here: {why}")
    print(f"torch {torch.__version__}, {args.threads} threads, batch {args.batch}, prompt {args.prompt}, "
          f"{args.steps} steps x {args.rounds} rounds an arm; THP: {pages.THP_SETTING.read_text().strip()}")
    print(f"{'row':<34} {'4k best':>8} {'median':>8} {'huge best':>8} {'median':>8} {'4k/huge':>8} "
          f"{'placed MB':>8} {'huge MB':>8}")
    for name in args.model.split(","):
        for w in args.weights.split(","):
            print(_row(f"{name} {w} step", _decode_arms(name, w, args)), flush=True)
    if args.gemv:
        from fewbits.kernels import rows

        n, k = (int(v) for v in args.gemv.split("x"))
        if not rows.available():
            raise SystemExit("fewbits_rows did not build")
        holder = torch.nn.Module()
        holder.register_buffer("w", torch.randn(n, k).to(torch.bfloat16))
        x = torch.randn(1, k).to(torch.bfloat16)

        def gemv() -> list[float]:
            out = []
            for _ in range(5):
                t0 = time.perf_counter()
                torch.ops.fewbits_rows.dense_mm(x, holder.w)
                out.append(time.perf_counter() - t0)
            return out

        gemv()
        arms = _arms([holder], gemv, args.rounds * 2)
        gb = n * k * 2 / 1e9
        a, b = statistics.median(arms["4k"]), statistics.median(arms["huge"])
        print(_row(f"dense_mm bf16 {n}x{k} (1 row)", arms) + f"   {gb / a:.1f} -> {gb / b:.1f} GB/s")


if __name__ == "__main__":
    main()
