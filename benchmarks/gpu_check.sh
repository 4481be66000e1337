#!/usr/bin/env bash
# The GPU acceptance check (issue #23), prepared to run once, end to end, on one GPU: expected
# about 6 minutes, every stage capped (10 minutes at most in all):
#   1. the CUDA-marked tests (pytest -m cuda): a bf16 step against the fp32 CPU reference,
#      FlexAttention training against SDPA with the dense mask, grouped-GEMM MoE against the
#      per-expert loop (no host syncs), pinned staging, async save and exact resume on the
#      device, the memory plan against the allocator's peak for a 1B model;
#   2. benchmarks/gpu.py: tokens/s per GPU and MFU for the 1B and 8B Llama presets (bf16,
#      FSDP2, compiled) against KempnerForge's 57.8% for 8B on one H200, in bf16 and FP8
#      (rowwise), the FP8 drift guard's cost (a check every 5 steps) and the deterministic
#      mode's, as one table (table.txt: each row against its preset's bf16 row).
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
# one interpreter checks the dependencies and reads the machine (torch's import is seconds)
probe='import attrs, cattrs, tomli, numpy, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print(int(torch.cuda.is_available()))'
if ! info=$("$py" -c "$probe" 2>/dev/null); then
    info=""
    if [ -d .whl ]; then
        "$py" -m pip install -q --no-index --no-deps --target /tmp/forge-site .whl/*.whl
        export PYTHONPATH="/tmp/forge-site:$PYTHONPATH"
    fi
fi
if [ -z "$info" ] && ! info=$("$py" -c "$probe"); then
    echo "error: $py lacks forge's dependencies (attrs, cattrs, tomli, numpy, torch): pip install -e . or put their wheels in .whl/" >&2
    exit 2
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    echo "$info" | head -n 1
} | tee "$out/machine.txt"

cuda=$(echo "$info" | tail -n 1)
status=0
# 1. the CUDA tests (expected about 2 minutes on an H200: the 1B memory test is the longest)
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS: the exact-resume test needs it
# only the files that mark a test cuda are collected: collecting the whole suite imports every
# optional extra (lm-eval, transformers), most of a minute on a small machine
cuda_files=$(grep -rlE "mark\.cuda|pytestmark.*cuda" tests --include=*.py | sort)
timeout -k 10 200 "$py" -m pytest -q -m cuda $cuda_files -rs -p no:cacheprovider --timeout=150 \
    --junitxml="$out/cuda_tests.xml" 2>&1 | tee "$out/cuda_tests.log" || status=1

# 2. throughput and the costs, one run per row (benchmarks/gpu.py; its own --timeout stops a
# run's whole torchrun group first, the outer one is the last resort). Rows in priority order;
# a row whose cap no longer fits the 10-minute budget (a device command's limit) is not run,
# and the table says so. Without CUDA each row is validated and planned (--dry-run): the
# rehearsal on a CPU, so that no config is run for the first time on the GPU.
budget=$(( 600 - SECONDS ))
rows=(
    "1b bf16 110"
    "1b fp8 110 --float8 rowwise"
    "8b bf16 170"
    "8b fp8 170 --float8 rowwise"
    "1b fp8-checked 110 --float8 rowwise --float8-check 5"
    "1b deterministic 110 --deterministic"
)
: > "$out/results.txt"
if [ "$cuda" != 1 ]; then
    # every row's dry run in one interpreter (a process a row would import torch six times),
    # each into the log its run would write
    "$py" - "$out" "${rows[@]}" <<'PY' || status=1
import contextlib, importlib.util, sys, traceback
spec = importlib.util.spec_from_file_location("gpu", "benchmarks/gpu.py")
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)
failed = 0
for row in sys.argv[2:]:
    preset, tag, _cap, *rest = row.split()
    with open(f"{sys.argv[1]}/gpu_benchmark_{preset}_{tag}.log", "w") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            argv = ["--dry-run", "--preset", preset, "--tag", tag, *rest]
            try:  # a row that raises fails alone, its traceback in its own log
                failed += gpu.main(argv) != 0
            except BaseException:
                traceback.print_exc()
                failed += 1
sys.exit(1 if failed else 0)
PY
fi
for row in "${rows[@]}"; do
    set -- $row
    preset=$1 tag=$2 cap=$3
    shift 3
    log="$out/gpu_benchmark_${preset}_${tag}.log"
    if [ "$cuda" != 1 ]; then
        :  # dry-run above
    elif [ $(( 600 - SECONDS )) -lt $(( cap + 30 )) ]; then
        echo "RESULT $preset $tag not-run out-of-budget" > "$log"
    else
        timeout -k 10 $(( cap + 30 )) "$py" benchmarks/gpu.py --preset "$preset" --tag "$tag" \
            --steps 12 --last 5 --timeout "$cap" --log-dir "$out" "$@" > "$log" 2>&1 || status=1
    fi
    grep -h "^RESULT" "$log" >> "$out/results.txt" || echo "RESULT $preset $tag failed see-log" >> "$out/results.txt"
    tail -n 4 "$log"
done
# one table: tokens/s per GPU, MFU (forge's count) and each row against its preset's bf16 row
"$py" - "$out/results.txt" <<'PY' | tee "$out/table.txt"
import sys
rows = [line.split()[1:] for line in open(sys.argv[1]) if line.startswith("RESULT")]
base = {p: float(t) for p, tag, t, _ in rows if tag == "bf16" and t.replace(".", "").isdigit()}
print(f"{'preset':<7}{'variant':<16}{'tokens/s/GPU':>14}{'MFU':>15}{'vs bf16':>9}")
for preset, tag, tokens, mfu in rows:
    number = tokens.replace(".", "").isdigit()
    ratio = f"{float(tokens) / base[preset]:.3f}" if number and preset in base else "-"
    shown = f"{float(mfu):.1%}" if mfu.replace(".", "").isdigit() else mfu
    print(f"{preset:<7}{tag:<16}{tokens:>14}{shown:>15}{ratio:>9}")
PY
if [ "$cuda" != 1 ]; then
    echo "gpu_check: no CUDA device here: the CUDA tests above were skipped (each with its reason); each benchmark row was validated and planned (dry-run), not run" >&2
    exit 2
fi
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo 'FAILED (see the logs in '"$out"')')"
exit $status
