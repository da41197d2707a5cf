#!/usr/bin/env bash
# The GPU measurements in one go, for a machine lent for a few minutes (each part bounded, the most wanted first):
#   1. bench/vs_official.py --device cuda --size base: LlamaGen GPT-B and MAR-B, specray target_only vs official
#   2. bench/compiled.py --device cuda: the compiled decode step (CUDA graphs) and head against eager
#   3. bench/gpu.py --dtype bfloat16: one call against one verify call at the release sizes
#   4. the compiled decode step at batch 32
# About 8 minutes at most (the parts' limits, 460 s, and the set-up).
# Usage: RESULTS=folder ARCHIVE=file.tgz bash bench/gpu_session.sh [WHEELS] [OFFICIAL]
#   WHEELS: a folder of wheels for packages the machine's Python lacks, installed into /tmp/site first (for an
#           image with torch, numpy, pyarrow, safetensors, timm and transformers: pydantic, pydantic_core,
#           annotated_types, typing_inspection, typing_extensions, diffusers, importlib_metadata, lazy-importer);
#   OFFICIAL: the official LlamaGen/MAR copy (default $SPECRAY_OFFICIAL or /tmp/official).
# Every part writes its log and JSON under $RESULTS (default gpu-out), and the folder is packed into $ARCHIVE
# (default $RESULTS.tgz) after each part: one file to bring back, whole even if a later part is killed. A part
# that fails or runs out of time leaves the others running.
set -u
RESULTS=${RESULTS:-gpu-out}
ARCHIVE=${ARCHIVE:-$RESULTS.tgz}
WHEELS=${1:-}
OFFICIAL=${2:-${SPECRAY_OFFICIAL:-/tmp/official}}
mkdir -p "$RESULTS"
# specray from this checkout (not installed there)
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-8} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

part() {  # part NAME SECONDS COMMAND...: run one measurement, its output to $RESULTS/NAME.log, bounded in time
    local name=$1 seconds=$2
    shift 2
    echo "=== $name (up to $seconds s): $*"
    local began=$SECONDS
    timeout -k 5 "$seconds" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - began)) s"
    grep -v -E '^(W|I)[0-9]{4} ' "$RESULTS/$name.log" | tail -n 15
    # a compiled function past torch's recompile limit runs eager from then on: say so beside the figures
    grep -i -m 5 "recompile_limit\|cache_size_limit\|runs eager from now on\|skipping cudagraphs" "$RESULTS/$name.log"
    tar czf "$ARCHIVE" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu \
        --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$RESULTS/machine.txt"

part vs_llamagen 60 python3 bench/vs_official.py --device cuda --size base --families llamagen --batches 1,8 \
    --reps 3 --official "$OFFICIAL" --json "$RESULTS/vs_llamagen.json"
part vs_mar 90 python3 bench/vs_official.py --device cuda --size base --families mar --batches 1,8 --reps 2 \
    --mar-steps 25 --official "$OFFICIAL" --json "$RESULTS/vs_mar.json"
# Compiling with CUDA graphs takes tens of seconds per call shape: batch 1 first, batch 32's shapes last.
part compiled_discrete 100 python3 bench/compiled.py --device cuda --families discrete --batches 1 --reps 3 \
    --samples-b1 2 --json "$RESULTS/compiled_discrete.json"
part compiled_continuous 50 python3 bench/compiled.py --device cuda --families continuous --batches 1,32 --reps 3 \
    --samples-b1 2 --json "$RESULTS/compiled_continuous.json"
part gpu_sizes 80 python3 bench/gpu.py --device cuda --dtype bfloat16 --reps 5 --out "$RESULTS/gpu_sizes.json"
part compiled_discrete_b32 80 python3 bench/compiled.py --device cuda --families discrete --batches 32 --reps 3 \
    --json "$RESULTS/compiled_discrete_b32.json"
