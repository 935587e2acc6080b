"""Peak memory and time of `fewbits quantize --stream` on random checkpoints with real models' shapes.

    PYTHONPATH=. python benchmarks/bench_stream.py --shape llama3-8b --method rtn    # ~16 GB checkpoint under /tmp
    PYTHONPATH=. python benchmarks/bench_stream.py --shape llama3.2-1b --method gptq --calib 8x256

Writes a random-weight checkpoint with the shapes of --shape as sharded bf16 safetensors (normal(0, 0.02)
weights, unit norms; every tensor generated and written a few rows at a time, so it is never whole in
memory), then runs `python -m fewbits quantize DIR --stream` under /usr/bin/time -v in a child process
and reports its peak resident memory and wall time, and the checkpoint's size for comparison.  The
output is checked: its manifest (sizes and sha256), and for checkpoints under 4 GB a load with
`api.load_quantized_model` and a forward pass with finite logits.  Everything is deleted at the end
unless --keep.  A calibrated method needs a tokenizer: SmolLM2's (packaged) is copied into the
checkpoint, its ids fit the 128k vocabulary; the calibration text is the packaged one.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
SHARD_BYTES = 2 << 30
ROWS_BYTES = 64 << 20


def make_checkpoint(out: Path, shape: str, seed: int = 0) -> int:
    """A random bf16 checkpoint with the shapes of `shape` in `out` (shards + index); returns its bytes."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from fewbits.tensorfile import TensorFileWriter

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **SHAPES[shape])
    with init_empty_weights():
        skeleton = LlamaForCausalLM(cfg)
    tensors = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]  # tied weights once
    if cfg.tie_word_embeddings:
        tensors = [(n, s) for n, s in tensors if n != "lm_head.weight"]
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    gen = torch.Generator().manual_seed(seed)
    total = sum(torch.Size(s).numel() * 2 for _, s in tensors)
    n_shards = -(-total // SHARD_BYTES)
    weight_map: dict[str, str] = {}
    shard, writer, size = 0, None, 0
    for name, shp in tensors:
        if writer is None or size >= SHARD_BYTES:
            if writer is not None:
                writer.close({"format": "pt"})
            shard += 1
            fname = f"model-{shard:05d}-of-{n_shards:05d}.safetensors"
            writer, size = TensorFileWriter(out / fname, n_tensors_hint=len(tensors)), 0
        rows = max(1, ROWS_BYTES // (2 * max(1, torch.Size(shp[1:]).numel())))

        def pieces(shp: tuple[int, ...] = shp, rows: int = rows, norm: bool = name.endswith("norm.weight")):
            for r in range(0, shp[0], rows):
                n = min(rows, shp[0] - r)
                if norm:
                    yield torch.ones((n, *shp[1:]), dtype=torch.bfloat16)
                else:
                    yield (torch.randn((n, *shp[1:]), generator=gen) * 0.02).to(torch.bfloat16)

        writer.add_pieces(name, torch.bfloat16, shp, pieces())
        weight_map[name] = fname
        size += torch.Size(shp).numel() * 2
    writer.close({"format": "pt"})
    if shard != n_shards:  # the shard names promised another count: rename them
        for old in sorted(set(weight_map.values())):
            new = re.sub(r"of-\d{5}", f"of-{shard:05d}", old)
            (out / old).rename(out / new)
            weight_map = {k: (new if v == old else v) for k, v in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def add_tokenizer(d: Path) -> None:
    from fewbits.models.packaged import ensure_converted

    src = ensure_converted("smollm2-135m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, d / f)


def run_quantize(src: Path, out: Path, fmt: str, method: str, dtype: str, calib: str, threads: int) -> dict:
    n, seq = (int(x) for x in calib.split("x"))
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "fewbits", "quantize", str(src), "--stream", "--format", fmt,
           "--method", method, "--dtype", dtype, "--calib-windows", str(n), "--calib-seq-len", str(seq),
           "-o", str(out), "--quiet"]
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"quantize failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    print(p.stdout.strip())
    return {"peak_rss": peak, "wall_s": wall}


def check_output(out: Path, small: bool) -> str:
    from fewbits.files import verify_dir

    verify_dir(out, required=True)
    if not small:
        return "manifest verified"
    from fewbits import api

    model, _, _ = api.load_quantized_model(out, chooser="reference")
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    return "manifest verified; loads, forward gives finite logits"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="llama3-8b")
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--format", dest="fmt", default="int4-g128")
    ap.add_argument("--dtype", default="bf16", help="dtype the blocks run in (--dtype of fewbits quantize)")
    ap.add_argument("--calib", default="8x256", help="calibration windows x tokens (calibrated methods)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/fewbits-bench-stream"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    args = ap.parse_args()
    dtype = args.dtype
    src, out = args.dir / f"{args.shape}-random", args.dir / f"{args.shape}-{args.method}-{args.fmt}"
    try:
        if not src.exists():
            t0 = time.perf_counter()
            total = make_checkpoint(src, args.shape)
            print(f"wrote {src}: {total / 1e9:.2f} GB bf16 in {time.perf_counter() - t0:.0f} s")
        total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        if args.method != "rtn":
            add_tokenizer(src)
        shutil.rmtree(out, ignore_errors=True)
        r = run_quantize(src, out, args.fmt, args.method, dtype, args.calib, args.threads)
        size = sum(f.stat().st_size for f in out.iterdir())
        note = check_output(out, small=size < 4e9)
        calib = f", calibration {args.calib} tokens" if args.method != "rtn" else ""
        print(f"{args.shape} ({total / 1e9:.2f} GB bf16 on disk) -> {args.method} {args.fmt} --stream --dtype {dtype}"
              f"{calib}, {args.threads} threads: peak RSS {r['peak_rss'] / 1e9:.2f} GB "
              f"({r['peak_rss'] / total:.2f}x the checkpoint), wall {r['wall_s']:.0f} s, output {size / 1e9:.2f} GB; "
              f"{note}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
