"""fewbits decode speed beside llama.cpp on the same model, prompt token ids, thread count and machine.

Model: a packaged one (`--model`: SmolLM2-135M-Instruct, Gemma-3-270M).  llama.cpp runs the packaged GGUF
as shipped (label `shipped`: SmolLM2's Q4_1 linears with a Q8_0 tied embedding/LM head; Gemma's Q4_K_M) and
GGUFs requantised from it with llama.cpp's own `llama_model_quantize`: F16 and BF16 (16-bit baselines) and
Q8_0 / Q4_0 with the embedding kept F16 (the bf16 rows of both engines hold the same dequantised values), and
with `--fewbits-gguf` fewbits' own GGUF exports.  fewbits loads the same weights (its cached conversion of
that GGUF), quantises the linears per format (`FORMAT+h:HEAD` the LM head too) with the kernel dispatcher's
fast CPU paths (`fewbits.bench.decode.load_quantized`) and decodes on its compiled static-cache step
(`--eager`: the eager path), timing every decode step.  Both engines: batch 1, greedy, the same random
prompt ids, `--steps` decode steps after the prefill, step times excluding the prefill; reported: the
fastest step (as `fewbits bench`) and the median.  Engines alternate within each repeat, so a burst of load
from another process hits both alike.

The gap is decomposed with the same measurement on 1-layer copies of each model (a truncated GGUF for
llama.cpp, the first decoder layer for fewbits): per-layer time = (t_full - t_1) / (L - 1) and the fixed
part of a step (embedding, LM head, sampling, framework) = t_1 - per-layer time; beside them the probe's
per-step overhead of a same-depth tiny-matrix model (`fewbits.bench.probe.step_overhead`) and llama.cpp's
own eval timer (its step time without the Python wrapper).

llama-cpp-python compiles llama.cpp and lives in its own virtual environment; this script (system python
with fewbits) drives it as a subprocess speaking JSON lines (`--llama-worker`):

    python -m venv /tmp/llcpp && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llcpp/bin/pip install llama-cpp-python
    python benchmarks/compare_llamacpp.py --llama-python /tmp/llcpp/bin/python --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TAG = "LLAMA_RESULT "


# ----------------------------------------------------------------- llama.cpp side (llama-cpp-python venv)
def _quantize(llama_cpp: Any, req: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own quantiser: `src` -> `dst` in ftype `req["ftype"]`, optional embedding type."""
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{req['ftype']}")
    params.allow_requantize = True
    params.nthread = int(req.get("threads", 2))
    if req.get("embd"):  # ggml's type ids (llama_cpp does not export GGML_TYPE_BF16)
        ggml_type = {"F16": 1, "Q8_0": 8, "BF16": 30}[req["embd"]]
        params.token_embedding_type = params.output_tensor_type = ggml_type
    tmp = req["dst"] + ".tmp"
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(req["src"].encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {req['src']} -> {req['ftype']} returned {rc}")
    os.replace(tmp, req["dst"])
    return {"seconds": time.perf_counter() - t0}


def _decode(llama_cpp: Any, llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    """Per prompt: prefill, then `steps` greedy one-token evals, each timed; llama.cpp's eval timer too."""
    import numpy as np

    def greedy() -> int:  # the last evaluated position's logits (the only row computed)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    runs = []
    for ids in req["prompts"]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = greedy()
        prefill = time.perf_counter() - t0
        llama_cpp.llama_perf_context_reset(llm.ctx)
        steps = []
        for _ in range(int(req["steps"])):
            t1 = time.perf_counter()
            llm.eval([tok])
            tok = greedy()
            steps.append(time.perf_counter() - t1)
        perf = llama_cpp.llama_perf_context(llm.ctx)
        runs.append({"prompt": len(ids), "prefill_s": prefill, "steps_s": steps,
                     "eval_ms_per_step": perf.t_eval_ms / max(perf.n_eval, 1), "n_eval": perf.n_eval})
    return {"runs": runs}


def llama_worker() -> None:
    """Serve JSON-line requests on stdin (quantize / decode / info); one JSON reply line each."""
    import llama_cpp

    loaded: dict[tuple[str, int, int], Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "info":
                out = {"version": llama_cpp.__version__,
                       "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
            elif req["op"] == "quantize":
                out = _quantize(llama_cpp, req)
            elif req["op"] == "decode":
                key = (req["model"], int(req["threads"]), int(req["n_ctx"]))
                if key not in loaded:
                    loaded.clear()
                    loaded[key] = llama_cpp.Llama(model_path=key[0], n_ctx=key[2], n_batch=512, n_ubatch=512,
                                                  n_threads=key[1], n_threads_batch=key[1], seed=0, verbose=False)
                out = _decode(llama_cpp, loaded[key], req)
            else:
                out = {"error": f"unknown op {req['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops with it
            out = {"error": repr(exc)}
        print(TAG + json.dumps(out), flush=True)


class Worker:
    """The driver's handle on the llama.cpp subprocess."""

    def __init__(self, python: str, log_path: str) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - llama.cpp's own messages, kept for the run
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--llama-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd="/")

    def _fail(self, msg: str) -> None:
        self.log.flush()
        with open(self.log_path) as fh:
            tail = fh.read()[-3000:]
        sys.exit(f"{msg}\n--- {self.log_path} ---\n{tail}")

    def __call__(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(TAG):
                out = json.loads(line[len(TAG):])
                if "error" in out:
                    self._fail(f"llama.cpp worker failed on {req['op']}: {out['error']}")
                return out
        self._fail(f"llama.cpp worker exited (rc {self.proc.wait()}) during {req['op']}")
        return {}

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


# ----------------------------------------------------------------- GGUF files
def gguf_facts(path: str) -> dict[str, Any]:
    """Bytes of all tensors, the embedding's storage type, and the linears' types of a GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    types = sorted({t.tensor_type.name for t in r.tensors if t.name.startswith("blk.") and t.name.endswith(
        "_q.weight")})
    embd = next(t.tensor_type.name for t in r.tensors if t.name == "token_embd.weight")
    return {"bytes": int(sum(int(t.n_bytes) for t in r.tensors)), "embd": embd, "linears": ",".join(types)}


def truncate_gguf(src: str, dst: str, n_layers: int) -> None:
    """Copy of `src` keeping only the first `n_layers` blocks (block_count rewritten), tensors byte for byte."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

    r = GGUFReader(src)
    arch = r.fields[Keys.General.ARCHITECTURE].contents()
    tmp = dst + ".tmp"
    w = GGUFWriter(tmp, arch)
    for f in r.fields.values():
        if f.name == Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        val = n_layers if f.name == f"{arch}.block_count" else f.contents()
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    keep = [t for t in r.tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers)]
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    os.replace(tmp, dst)


def joined_gguf(parts: list[Any], workdir: str) -> str:
    """The packaged GGUF as one file: itself, or its parts (a package ships a large file split) joined once
    into `workdir`."""
    if len(parts) == 1:
        return str(parts[0])
    dst = os.path.join(workdir, os.path.basename(str(parts[0])).split(".gguf")[0] + ".gguf")
    if not os.path.exists(dst):
        with open(dst + ".tmp", "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
        os.replace(dst + ".tmp", dst)
    return dst


def llama_models(worker: Worker, packaged: str, workdir: str, kinds: list[str]) -> dict[str, str]:
    """label -> GGUF path: the packaged file, and requantised ones made once into `workdir`."""
    os.makedirs(workdir, exist_ok=True)
    paths = {"shipped": packaged}
    stem = os.path.basename(packaged).removesuffix(".gguf")
    f16 = os.path.join(workdir, f"{stem}.F16.gguf")
    recipes = {"F16": (packaged, "MOSTLY_F16"), "BF16": (packaged, "MOSTLY_BF16"), "Q8_0": (f16, "MOSTLY_Q8_0"),
               "Q4_0": (f16, "MOSTLY_Q4_0")}
    for kind in ["F16", *kinds]:
        if kind in paths:
            continue
        src, ftype = recipes[kind]
        dst = os.path.join(workdir, f"{stem}.{kind}.gguf")
        if not os.path.exists(dst):
            embd = kind if kind in ("F16", "BF16") else "F16"
            secs = worker(op="quantize", src=src, dst=dst, ftype=ftype, embd=embd)["seconds"]
            print(f"llama.cpp quantised {os.path.basename(src)} -> {kind} (embedding {embd}) in {secs:.1f} s")
        paths[kind] = dst
    return {k: paths[k] for k in kinds}


# ----------------------------------------------------------------- fewbits side
def weight_bytes(model: Any) -> int:
    """Stored bytes of the weights: packed quantised linears plus every other (deduplicated) parameter."""
    from fewbits.models.qlinear import QuantLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.weight_nbytes for m in model.modules() if isinstance(m, QuantLinear))


def first_layers(model: Any, n: int) -> Any:
    """Shallow copy of a causal LM keeping its first `n` decoder layers (sharing their weights)."""
    import copy

    import torch

    def shallow(m: Any) -> Any:  # new module object with its own child table, same children
        c = copy.copy(m)
        c.__dict__["_modules"] = m._modules.copy()
        c.__dict__.pop("_fewbits_decoders", None)  # the full model's compiled steps: the copy builds its own
        return c

    small = shallow(model)
    small.model = shallow(model.model)
    small.model.layers = torch.nn.ModuleList(list(model.model.layers)[:n])
    small.config = copy.deepcopy(model.config)
    small.config.num_hidden_layers = n
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:n]
    small.model.config = small.config
    return small


EAGER = False  # --eager: fewbits' eager decode path instead of the compiled static-cache step
COMPILE_S: dict[int, float] = {}  # id(model) -> seconds spent compiling (or loading) its steps


def fewbits_decode(model: Any, prompts: list[list[int]], steps: int) -> list[list[float]]:
    import torch

    from fewbits.decode.generate import generate_static
    from fewbits.generate import generate

    out = []
    for ids in prompts:
        res = (generate if EAGER else generate_static)(model, torch.tensor([ids]), steps + 1)
        COMPILE_S[id(model)] = COMPILE_S.get(id(model), 0.0) + res.compile_s
        out.append(res.decode_step_s)
    return out


def op_profile(model: Any, steps: int = 32, top: int = 6) -> dict[str, Any]:
    """torch.profiler over `steps` one-token forwards (a 1-token prompt, so prefill is a decode step too):
    per step, the wall time, the aten ops called, their summed self time, and the costliest ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fewbits.generate import generate

    ids = torch.tensor([[1]])
    generate(model, ids, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        generate(model, ids, steps)
        wall = (time.perf_counter() - t0) / steps
    ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in ev), key=lambda x: -x[1])
    return {"wall_ms": wall * 1e3, "op_ms": sum(o[1] for o in ops), "ops": sum(o[2] for o in ops), "top": ops[:top]}


# ----------------------------------------------------------------- driver
def _stat(xs: list[float]) -> tuple[float, float]:
    return min(xs), statistics.median(xs)


def measure(engines: dict[str, Any], prompts: list[list[int]], steps: int, repeats: int,
            threads: int) -> dict[str, list[list[float]]]:
    """label -> per prompt, step times of every repeat pooled; engines alternate (order reversed each repeat)."""
    out: dict[str, list[list[float]]] = {k: [[] for _ in prompts] for k in engines}
    names = list(engines)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            for i, s in enumerate(engines[name](prompts, steps)):
                out[name][i] += s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", default="/tmp/llcpp/bin/python", help="python of the llama-cpp-python venv")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats per engine (steps pooled)")
    ap.add_argument("--fewbits", default="bf16,int8,int4-g64,int4-g32",
                    help="fewbits formats; FORMAT+h:HEAD also quantises the LM head (e.g. int4-g32-asym+h:int8, "
                         "as the packaged SmolLM2 file's Q8_0 head); a trailing +a8 lets the kernels round the "
                         "activations to int8 as llama.cpp's do (e.g. int4-g32+h:int8+a8)")
    ap.add_argument("--gguf", default="shipped,BF16,F16,Q8_0,Q4_0",
                    help="llama.cpp files: `shipped` is the packaged GGUF as shipped, the others llama.cpp's own "
                         "requantisations of it")
    ap.add_argument("--no-layers", action="store_true", help="skip the 1-layer decomposition")
    ap.add_argument("--ops", action="store_true", help="also profile fewbits' step per aten op (first thread count)")
    ap.add_argument("--workdir", default="/tmp/fewbits_llamacpp", help="where requantised GGUFs are kept")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--eager", action="store_true", help="fewbits' eager decode instead of the compiled step")
    ap.add_argument("--fewbits-gguf", default=None, metavar="[LABEL=]FILE,...",
                    help="also run llama.cpp on these GGUFs exported by fewbits (e.g. `fewbits quantize smollm2-135m "
                         "--format int4-g32 --to gguf`: Q4_0 from fewbits' own codes); label default fbQ4_0")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global EAGER
    EAGER = args.eager
    if args.llama_worker:
        llama_worker()
        return

    import torch

    from fewbits.bench.decode import load_quantized, model_spec, split_activations
    from fewbits.bench.machine import memory_bandwidth
    from fewbits.bench.probe import skeleton_model
    from fewbits.models.packaged import packaged_entry, source_files

    threads = [int(t) for t in args.threads.split(",")]
    plens = [int(p) for p in args.prompts.split(",")]
    fb_formats = [f for f in args.fewbits.split(",") if f]
    kinds = [k for k in args.gguf.split(",") if k]
    os.makedirs(args.workdir, exist_ok=True)
    packaged = joined_gguf(source_files(packaged_entry(args.model)), args.workdir)
    worker = Worker(args.llama_python, os.path.join(args.workdir, "llama_worker.log"))
    info = worker(op="info")
    ggufs = llama_models(worker, packaged, args.workdir, kinds)
    for item in (args.fewbits_gguf or "").split(","):
        if item:
            label, _, path = item.rpartition("=")
            label = label or "fbQ4_0"
            ggufs[label] = os.path.join(path, "model.gguf") if os.path.isdir(path) else path
            kinds.append(label)
    facts = {k: gguf_facts(p) for k, p in ggufs.items()}

    fb: dict[str, Any] = {}
    for f in fb_formats:
        spec, act = split_activations(f)
        body, _, head = spec.partition("+h:")
        model, kernels = load_quantized(args.model, body, lm_head=head or None, activations=act)
        fb[f] = (model, kernels, weight_bytes(model))
    m0 = fb[fb_formats[0]][0]
    n_layers = int(m0.config.num_hidden_layers)
    vocab = int(m0.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    n_ctx = max(plens) + args.steps + 16

    own: dict[tuple[str, int], list[float]] = {}  # llama.cpp's eval timer, ms per step, per prompt

    def llama_engine(path: str, t: int) -> Any:
        def run(ps: list[list[int]], n: int) -> list[list[float]]:
            runs = worker(op="decode", model=path, threads=t, n_ctx=n_ctx, prompts=ps, steps=n)["runs"]
            own[(path, t)] = [r["eval_ms_per_step"] for r in runs]
            return [r["steps_s"] for r in runs]
        return run

    def fb_engine(model: Any) -> Any:
        return lambda ps, n: fewbits_decode(model, ps, n)

    results: dict[str, Any] = {"llama_cpp": info, "threads": {}, "facts": facts}
    print(f"llama-cpp-python {info['version']}; {info['system_info'].strip()}")
    print(f"torch {torch.__version__}; {args.model}: {n_layers} layers, vocab {vocab}; prompts {plens} random ids "
          f"(seed 0, identical for both engines); {args.steps} decode steps; {args.repeats} alternating repeats")
    print("fewbits kernels: " + "; ".join(f"{f} {fb[f][1]}" for f in fb_formats) + "; LM head and embedding bf16")
    bw = memory_bandwidth(1 << 29)
    results["bandwidth"] = bw
    print(f"memory bandwidth (probe, read-only sum, best of 5): {bw / 1e9:.1f} GB/s")
    for t in threads:
        torch.set_num_threads(t)
        engines = {f"fewbits {f}": fb_engine(fb[f][0]) for f in fb_formats}
        engines.update({f"llama.cpp {k}": llama_engine(p, t) for k, p in ggufs.items()})
        times = measure(engines, prompts, args.steps, args.repeats, t)
        eval_ms = {k: own[(p, t)] for k, p in ggufs.items()}  # from the last repeat
        results["threads"][t] = {"step_s": times, "llama_eval_ms": eval_ms}
        print_table(t, plens, times, fb, facts, fb_formats, kinds, eval_ms)
        print(f"fewbits path: {'eager' if EAGER else 'compiled'}; compile (or cache load) s per model, apart from "
              "the steps: " + ", ".join(f"{f} {COMPILE_S.get(id(fb[f][0]), 0.0):.1f}" for f in fb_formats))
        for f in fb_formats:  # every fewbits format against every llama.cpp file, median steps, first prompt
            med = statistics.median(times[f"fewbits {f}"][0])
            print(f"  fewbits {f}: " + ", ".join(
                f"{statistics.median(times[f'llama.cpp {k}'][0]) / med:.2f}x llama.cpp {k}" for k in kinds))
        if not args.no_layers:
            nbytes = {**{f"fewbits {f}": fb[f][2] for f in fb_formats},
                      **{f"llama.cpp {k}": facts[k]["bytes"] for k in kinds}}
            results["threads"][t]["layers"] = decompose(t, plens, prompts, args, fb, ggufs, n_layers, times,
                                                        llama_engine, fb_engine, nbytes)
            ovh = statistics.median(fewbits_decode(skeleton_model(model_spec(args.model, m0)), prompts[:1],
                                                   args.steps)[0])
            results["threads"][t]["skeleton_step_s"] = ovh
            print(f"fewbits step of the probe's skeleton (same depth, heads, vocabulary; 16-wide matrices) at "
                  f"p{plens[0]}: {ovh * 1e3:.2f} ms (median)")
        if args.ops and t == threads[0]:
            print(f"\n--- threads {t}: fewbits step under torch.profiler (per step; aten self times) ---")
            results["ops"] = {}
            for f in fb_formats:
                r = results["ops"][f] = op_profile(fb[f][0])
                top = ", ".join(f"{k.removeprefix('aten::')} {ms:.2f} ms/{n:.0f}" for k, ms, n in r["top"])
                print(f"{f:>9}: wall {r['wall_ms']:.1f} ms, {r['ops']:.0f} aten ops, {r['op_ms']:.1f} ms in ops, "
                      f"{r['wall_ms'] - r['op_ms']:.1f} ms outside them; top: {top}")
    worker.close()
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(results, fh, indent=1)
        os.replace(tmp, args.json)


PAIRS = {"bf16": "BF16", "int8": "Q8_0", "int4-g64": "Q4_0", "int4-g32": "Q4_0"}


def print_table(t: int, plens: list[int], times: dict[str, list[list[float]]], fb: dict[str, Any],
                facts: dict[str, Any], fb_formats: list[str], kinds: list[str],
                eval_ms: dict[str, list[float]]) -> None:
    """tok/s (fastest step / median step) per prompt; ratio to fewbits bf16 and fewbits / llama.cpp same bits."""
    from fewbits.bench.decode import split_activations

    def tps(label: str, i: int) -> tuple[float, float]:
        best, med = _stat(times[label][i])
        return 1 / best, 1 / med

    print(f"\n--- threads {t}: decode tok/s at batch 1 = 1 / step time (fastest step | median step) ---")
    head = "".join(f"{'p' + str(p) + ' best':>10}{'median':>8}" for p in plens)
    print(f"{'engine':<10}{'format':<9}{'linears':>9}{'embd/head':>10}{'MB':>7}{head}"
          f"{'vs fb bf16':>11}{'fb/llama':>9}{'llama own ms':>13}")
    base = "fewbits " + fb_formats[0]
    rows = [("fewbits", f, f.partition("+h:")[0], "bf16/" + (split_activations(f)[0].partition("+h:")[2] or "bf16"),
             fb[f][2])
            for f in fb_formats]
    rows += [("llama.cpp", k, facts[k]["linears"], facts[k]["embd"], facts[k]["bytes"]) for k in kinds]
    for eng, fmt, lin, embd, nbytes in rows:
        label = f"{eng} {fmt}"
        cells = "".join(f"{tps(label, i)[0]:10.1f}{tps(label, i)[1]:8.1f}" for i in range(len(plens)))
        vs = tps(label, 0)[1] / tps(base, 0)[1]
        other = f"llama.cpp {PAIRS.get(fmt, '')}"
        ratio = (f"{tps(label, 0)[1] / tps(other, 0)[1]:8.2f}x" if eng == "fewbits" and other in times
                 else f"{'':>9}")
        own = "/".join(f"{x:.2f}" for x in eval_ms[fmt]) if eng == "llama.cpp" else ""
        print(f"{eng:<10}{fmt:<9} {lin:>9}{embd:>10}{nbytes / 1e6:7.1f}{cells}{vs:10.2f}x{ratio}{own:>13}")
    print(f"ratios: median steps at p{plens[0]}; fb/llama pairs {PAIRS}; 'llama own ms' = llama.cpp's eval "
          f"timer per step (no Python wrapper), per prompt")


def decompose(t: int, plens: list[int], prompts: list[list[int]], args: argparse.Namespace, fb: dict[str, Any],
              ggufs: dict[str, str], n_layers: int, times: dict[str, list[list[float]]], llama_engine: Any,
              fb_engine: Any, nbytes: dict[str, int]) -> dict[str, Any]:
    """1-layer copies, same prompts: per-layer and fixed time of a step (medians, first prompt length)."""
    engines = {f"fewbits {f}": fb_engine(first_layers(m, 1)) for f, (m, _, _) in fb.items()}
    for k, p in ggufs.items():
        small = os.path.join(args.workdir, f"{os.path.basename(p).removesuffix('.gguf')}.1layer.gguf")
        if not os.path.exists(small):
            truncate_gguf(p, small, 1)
        engines[f"llama.cpp {k}"] = llama_engine(small, t)
    one = measure(engines, prompts[:1], args.steps, args.repeats, t)
    out = {}
    print(f"\n--- threads {t}: where a step goes (median ms at p{plens[0]}; {n_layers}-layer vs 1-layer copy) ---")
    print(f"{'engine / format':<22}{'full':>8}{'1 layer':>9}{'per layer':>10}{'fixed':>8}{'layers':>8}"
          f"{'weights GB/s':>13}")
    for label in engines:
        full = statistics.median(times[label][0]) * 1e3
        t1 = statistics.median(one[label][0]) * 1e3
        per = (full - t1) / (n_layers - 1)
        out[label] = {"full_ms": full, "one_layer_ms": t1, "per_layer_ms": per, "fixed_ms": t1 - per}
        print(f"{label:<22}{full:8.2f}{t1:9.2f}{per:10.3f}{t1 - per:8.2f}{per * n_layers:8.2f}"
              f"{nbytes[label] / full / 1e6:13.1f}")
    print("per layer = (full - 1 layer) / (L - 1); fixed = 1 layer - per layer (embedding, LM head, sampling, "
          "framework); weights GB/s = weight bytes / full step")
    return out


if __name__ == "__main__":
    main()
