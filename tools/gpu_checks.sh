#!/usr/bin/env bash
# The checks docs/gpu.md reports, as one command for a lent GPU machine (no TensorRT there, no
# network): the kernels' tests, compute-sanitizer, TtaDistance against cuBLAS, and the variants
# placed in transformers-hosted families in torch fp16 (tests/test_hosts_gpu.py, then their speed).
# Every step has its own time limit and writes its log under $OUT, so a run cut short still returns
# what it finished. ONLY=hosts runs the hosted-family steps alone; FAMILIES=" " skips their speed runs.
#
# Carry plugins/lib (the library `make test` built, sm_90 included) and, where the GPU machine's
# transformers is older than the one attnx is tested with, .whl/ holding that transformers wheel.
set -u
OUT=${OUT:-/tmp/attnx-gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
export PYTHONUNBUFFERED=1 ATTNX_PLUGINS_WERROR=0
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src  # the path an editable install writes: no install here

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "=== $name: $*" >>"$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" >>"$LOG"
    echo "$name: rc=$rc in $((SECONDS - t0)) s"
}

{ nvidia-smi -L; nvcc --version | tail -1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >>"$LOG" 2>&1
PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider tests/test_plugins_gpu.py"
HOSTS="python3 -m pytest -q -rfE -p no:cacheprovider tests/test_hosts_gpu.py"
SANITIZED='sanitizer or unaligned_inputs'
if [ "${ONLY:-all}" != hosts ]; then
step plugins-tests "${T_TESTS:-100}" $PYTEST
PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck "${T_SAN:-110}" \
    compute-sanitizer --tool memcheck --error-exitcode 9 $PYTEST -k "$SANITIZED"
step racecheck "${T_SAN:-110}" compute-sanitizer --tool racecheck --error-exitcode 9 $PYTEST -k "$SANITIZED"
step tta-vs-cublas "${T_TTA:-60}" python3 benchmarks/bench_kernels_gpu.py --ops tta --lengths 512 1024 2048 \
    --rounds 5 --json "$OUT/tta.json"
fi
step hosts-tests "${T_TESTS:-100}" $HOSTS
for family in ${FAMILIES:-llama modernbert qwen2}; do
    step "hosts-$family" "${T_HOST:-60}" python3 benchmarks/bench_variants_gpu.py --family "$family" \
        --dtypes float16 --batch "${BATCH:-4}" --lengths 512 2048 --rounds 3 --json "$OUT/hosts-$family.json"
done
tail -c 11000 "$LOG"
