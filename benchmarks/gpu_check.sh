#!/usr/bin/env bash
# The GPU acceptance check (issue #23), prepared to run once, end to end, on one GPU: expected
# about 6 minutes, every stage capped (10 minutes at most in all):
#   1. the CUDA-marked tests (pytest -m cuda): a bf16 step against the fp32 CPU reference,
#      FlexAttention training against SDPA with the dense mask, grouped-GEMM MoE against the
#      per-expert loop (no host syncs), pinned staging, async save and exact resume on the
#      device, the memory plan against the allocator's peak for a 1B model;
#   2. benchmarks/gpu.py: tokens/s per GPU and MFU for the 1B and 8B Llama presets (bf16,
#      FSDP2, compiled) against KempnerForge's 57.8% for 8B on one H200.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: $OUT, else /tmp/gpu_check)
#
# On a machine without CUDA the tests are collected and skipped with their reason, and the
# benchmark says it needs a GPU. Python: $PYTHON, else .venv/bin/python, else python3. Missing
# pure-Python dependencies (cattrs, tomli) are installed from wheels in .whl/ when that folder
# exists (a machine with no package index), into a folder on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$out"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$py" -c "import attrs, cattrs, tomli, numpy, torch" 2>/dev/null && [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/forge-site .whl/*.whl
    export PYTHONPATH="/tmp/forge-site:$PYTHONPATH"
fi
if ! "$py" -c "import attrs, cattrs, tomli, numpy, torch"; then
    echo "error: $py lacks forge's dependencies (attrs, cattrs, tomli, numpy, torch): pip install -e . or put their wheels in .whl/" >&2
    exit 2
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} | tee "$out/machine.txt"

cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
status=0
# 1. the CUDA tests (expected about 2 minutes on an H200: the 1B memory test is the longest)
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS: the exact-resume test needs it
# only the files that mark a test cuda are collected: collecting the whole suite imports every
# optional extra (lm-eval, transformers), most of a minute on a small machine
cuda_files=$(grep -rlE "mark\.cuda|pytestmark.*cuda" tests --include=*.py | sort)
timeout -k 10 200 "$py" -m pytest -q -m cuda $cuda_files -rs -p no:cacheprovider --timeout=150 \
    --junitxml="$out/cuda_tests.xml" 2>&1 | tee "$out/cuda_tests.log" || status=1

if [ "$cuda" != 1 ]; then
    echo "gpu_check: no CUDA device here: the CUDA tests above were skipped (each with its reason) and the benchmark was not run" >&2
    exit 2
fi
# 2. throughput, one preset at a time (expected about 1 and 3 minutes): benchmarks/gpu.py's own
# --timeout stops a preset's whole torchrun group first; the outer one is the last resort.
# Every cap together stays under 10 minutes (a device command's limit).
for preset in "1b 120" "8b 210"; do
    set -- $preset
    timeout -k 10 $(( $2 + 30 )) "$py" benchmarks/gpu.py --preset "$1" --steps 12 --last 5 \
        --timeout "$2" --log-dir "$out" 2>&1 | tee "$out/gpu_benchmark_$1.log" || status=1
done

echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo 'FAILED (see the logs in '"$out"')')"
exit $status
