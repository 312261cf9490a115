#!/usr/bin/env bash
# Device run: every GPU test (page manager, reference path, paged cache, attention kernels, model),
# then the page-manager and attention benchmarks.
# Usage (on the GPU machine, repository root): bash tools/gpu_check.sh
# The suite outlasts one device call (10 minutes): run it in shards, one call each,
#   DIFFKV_TEST_SHARD=1/4 GPU_CHECK_BENCH=0 bash tools/gpu_check.sh   ... 4/4 (tests/conftest.py)
# with GPU_CHECK_BENCH=0 skipping the benchmarks at the end (run them in one of the calls).
# The default model's GPU tests need the model carried over two calls first
# (tools/gpu_model_carry.sh); without it they skip themselves.
# Writes gpu_info.txt, gpu_tests.log, bench.log, page_manager.json and attention.json under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DIFFKV_COMMIT=${DIFFKV_COMMIT:-$(git rev-parse --verify -q HEAD || echo uncommitted)}
source tools/gpu_model_carry.sh assemble || echo "default model not carried: its GPU tests skip"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >"$OUT/gpu_info.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$OUT/gpu_info.txt"
rc=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
# device-agnostic files (the CPU runs them under the Triton interpreter; here they run on the GPU), not marked gpu
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_decode_attention.py tests/kernels/test_cuda_decode.py \
    tests/kernels/test_custom_ops.py 2>&1 | tee -a "$OUT/gpu_tests.log" || rc=1
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
    python3 benchmarks/bench_page_manager.py --out "$OUT/page_manager.json" 2>&1 | tee "$OUT/bench.log" || rc=1
    python3 benchmarks/bench_attention.py --out "$OUT/attention.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
echo "results in $OUT (exit $rc)"
exit $rc
