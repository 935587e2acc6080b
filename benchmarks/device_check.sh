#!/usr/bin/env bash
# One prepared run of fewbits' GPU paths on a CUDA machine, sized to a few minutes of device time:
#   1. the GPU tests (Triton / _scaled_mm kernels against the reference, generate on the GPU vs the CPU,
#      probe and bench on the GPU),
#   2. GEMV at decode shapes through the dispatcher (bf16 / int8 / int4-g128 / fp8-e4m3, ratios side by side),
#   3. a profile of SmolLM2-135M's decode steps (benchmarks/profile_step.py) and a sweep of the Triton
#      kernel's tiles at decode shapes (benchmarks/tune_gemv.py), when asked for,
#   4. `fewbits probe` then `fewbits bench` for SmolLM2-135M and for Llama-3-8B, both with random weights
#      (a step's time depends on shapes, formats and kernels, not on the values; the weights cannot travel);
#      Llama-3-8B on issue 16's rows: bf16 / int4-g128 / fp8-e4m3 weights, batch 1 and 16, a 512-token prompt,
#      every row a compiled CUDA-graph step (one compile a row: the stage prints each row as it finishes),
#   5. GPTQ int4-g128 of a random Llama-3-8B on the GPU, 128 x 2048 calibration tokens, timed
#      (benchmarks/bench_calib_device.py; issue 18's goal: under 3 minutes on an H200), when asked for.
#
# Usage, from the repository root:  OUT=/some/dir bash benchmarks/device_check.sh [STAGES]
# STAGES: a comma-separated list of tests, gemv, profile, tune, smollm2, calib, llama3-8b (in that order whatever
# the list's), or "all" (tests,gemv,smollm2,llama3-8b, the default) or "quick" (all but llama3-8b); two
# calls on one warm machine can split a run (e.g. "tests,gemv,tune", then "llama3-8b").  Each stage has its own time limit and a failing stage does not
# stop the next; a stage that would start after BUDGET seconds (default 560) is skipped.  DEVICE=cpu runs
# the same stages on the CPU (a dry run of the script; the GPU tests then skip, and LIMIT_SCALE=4 gives the
# slower CPU four times each limit).  Writes under $OUT (at most 10 files): log.txt (everything printed),
# gemv.txt, profile.txt, tune.txt, calib.json, probe-<model>.json / bench-<model>.json and bench-llama3-8b-b16.json.  Runs from the source tree
# (PYTHONPATH), nothing is installed.
set -u
OUT=${OUT:-/tmp/fewbits-device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STAGES=${1:-all}
case "$STAGES" in
    all) STAGES=tests,gemv,smollm2,llama3-8b ;;
    quick) STAGES=tests,gemv,smollm2 ;;
esac
has() { [[ ",$STAGES," == *",$1,"* ]]; }
DEVICE=${DEVICE:-cuda}
LIMIT_SCALE=${LIMIT_SCALE:-1}
BUDGET=${BUDGET:-560}

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, report its status and duration
    local name=$1 limit=$(($2 * LIMIT_SCALE)) t0=$SECONDS
    shift 2
    if [ "$SECONDS" -gt $((BUDGET * LIMIT_SCALE)) ]; then
        echo "=== $name: skipped, ${SECONDS} s spent of the ${BUDGET} s budget"
        return
    fi
    echo "=== $name (limit ${limit} s): $*"
    timeout "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS - t0)) s"
}

pair() {  # pair MODEL TAG PROBE_LIMIT BENCH_LIMIT [bench options...]
    local model=$1 tag=$2 plimit=$3 blimit=$4
    shift 4
    stage "probe $tag" "$plimit" $PY -m fewbits probe --device "$DEVICE" --model "$model" --name "$DEVICE-$tag" \
        -o "$OUT/probe-$tag.json"
    more "$model" "$tag" "$tag" "$blimit" "$@"
}

more() {  # more MODEL TAG NAME LIMIT [bench options...]: another bench against pair's probe, into bench-NAME.json
    local model=$1 tag=$2 name=$3 limit=$4
    shift 4
    if [ -f "$OUT/probe-$tag.json" ]; then
        stage "bench $name" "$limit" $PY -m fewbits bench "$model" --random-weights --device "$DEVICE" \
            --profile "$OUT/probe-$tag.json" --json "$OUT/bench-$name.json" "$@"
    fi
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
    $PY -c "import triton; print('triton', triton.__version__)"
    has tests && stage tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/bench tests/decode \
        tests/test_generate.py tests/methods tests/calib
    has gemv && stage gemv 60 $PY benchmarks/bench_gemv.py --device "$DEVICE" --specs bf16,int8,int4-g128,fp8-e4m3 \
        --min-mb 512 --rounds 20 | tee "$OUT/gemv.txt"
    has profile && stage profile 50 $PY benchmarks/profile_step.py smollm2-135m --random-weights --device "$DEVICE" \
        --weights bf16,int8 --steps 8 --threads 0,1 --top 15 | tee "$OUT/profile.txt"
    has tune && stage tune 150 $PY benchmarks/tune_gemv.py --specs int8,int4-g128 --shapes 14336x4096,4096x14336 \
        --block-n 64 --block-k 128 --split 1,4,8 --gemv-n 4,8,16 --gemv-k 512,1024 --warps 4,8 \
        | tee "$OUT/tune.txt"
    has smollm2 && pair smollm2-135m smollm2 80 80
    has calib && stage "gptq llama-3-8b" 240 $PY benchmarks/bench_calib_device.py --device "$DEVICE" \
        --model llama-3-8b --format int4-g128 --method gptq --samples 128 --seq-len 2048 --json "$OUT/calib.json"
    # batch 1 and batch 16 apart: each row compiles its own step, and the first file must survive a slow second
    has llama3-8b && pair llama-3-8b llama3-8b 120 200 --weights bf16,int4-g128,fp8-e4m3 --kv bf16 \
        --batch 1 --prompt 512 --steps 16
    has llama3-8b && more llama-3-8b llama3-8b llama3-8b-b16 200 --weights bf16,int4-g128,fp8-e4m3 --kv bf16 \
        --batch 16 --prompt 512 --steps 16
    date -u
} 2>&1 | tee "$OUT/log.txt"
