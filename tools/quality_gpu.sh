#!/usr/bin/env bash
# The generation-level quality run on one GPU (docs/QUALITY.md): the copy and recall tasks of one model for a
# list of points, through the LLM API (`trtllm-diffkv eval`, one model load per process, each point's executor
# sized for its batch, CUDA graphs on), written to OUT_DIR/quality.json, quality_details.json, quality.png and
# quality_gpu.log.
#
#   bash tools/quality_gpu.sh OUT_DIR MODEL POINTS [trtllm-diffkv eval arguments ...]
#
#   MODEL   a checkpoint path, a model name the loader resolves (gemma3-270m), or "default" (SmolLM2-135M)
#   POINTS  comma-separated presets / kv-config files / kivi-4 (fp16 always runs); custom DiffKV points go
#           in the eval arguments as --point 'PRESET,FIELD=VALUE,...'
#
# Environment:
#   QUALITY_GPU_SHARDS    eval processes side by side on the GPU, each on every SHARDS-th case (default 2: one
#                         process's host work between steps leaves the GPU idle part of the time)
#   QUALITY_GPU_PART      I/P: this call runs part I (0-based) of P calls' worth of cases (default 0/1); merge the
#                         calls' OUT_DIR/quality_details.json afterwards with
#                         `trtllm-diffkv eval --merge-details A/quality_details.json B/... --output FILE`
#   QUALITY_GPU_TIME_LIMIT_S  each process starts no point after this (default 480); stopped 60 s later
#   QUALITY_GPU_WORK      shard files and logs (default /tmp/quality_gpu)
#
# A point that started finishes (its files are rewritten after every point), so a process stopped by the time
# limit keeps every point it finished; the merge pairs points only on the cases both ran.
# Example (n = 160 per task, 8 points, one call per model):
#   source tools/gpu_carry.sh assemble && DIFFKV_COMMIT=abc1234 bash tools/quality_gpu.sh $OUT gemma3-270m \
#     fp16,k8v8,k8v4,diffkv,default-k8v2,default-unrotated --num-cases 160 --point 'diffkv,alpha_high=0.5' \
#     --point 'diffkv,score_pool_tokens=5'
set -u -o pipefail
[ $# -ge 3 ] || { sed -n '2,20p' "$0" >&2; exit 2; }
out=$1 model=$2 points=$3
shift 3
shards=${QUALITY_GPU_SHARDS:-2} part=${QUALITY_GPU_PART:-0/1} limit=${QUALITY_GPU_TIME_LIMIT_S:-480}
work=${QUALITY_GPU_WORK:-/tmp/quality_gpu}
part_i=${part%/*} parts=${part#*/}
total=$((shards * parts))
model_args=()
[ "$model" = default ] || model_args=(--model "$model")
mkdir -p "$out" "$work"
log="$out/quality_gpu.log"
: >"$log"
start=$(date +%s)
# Load once before the shards start: the first load of a GGUF converts it (into the cache root, trtllm_diffkv/user_cache.py).
python3 -c "import sys; from trtllm_diffkv.model.loader import load_model; load_model(sys.argv[1] if len(sys.argv) > 1 else None)" \
    "${model_args[@]:1}" >>"$log" 2>&1 || { echo "the model did not load" >>"$log"; exit 1; }
pids=()
for j in $(seq 0 $((shards - 1))); do
    shard=$((part_i * shards + j))
    PYTHONUNBUFFERED=1 timeout "$((${limit%.*} + 60))" python3 -m trtllm_diffkv eval "${model_args[@]}" \
        --tasks copy,recall --points "$points" --shard "$shard/$total" --time-limit-s "$limit" --no-plot \
        --no-progress --output "$work/shard$shard.json" "$@" >"$work/shard$shard.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
details=()
for j in $(seq 0 $((shards - 1))); do
    shard=$((part_i * shards + j))
    { echo "== shard $shard/$total"; cat "$work/shard$shard.log"; } >>"$log"
    [ -f "$work/shard${shard}_details.json" ] && details+=("$work/shard${shard}_details.json")
done
[ ${#details[@]} -gt 0 ] || { echo "no shard wrote results" >>"$log"; exit 1; }
python3 -m trtllm_diffkv eval --merge-details "${details[@]}" --output "$out/quality.json" >>"$log" 2>&1 || rc=1
echo "quality_gpu: $(( $(date +%s) - start )) s, exit $rc" >>"$log"
exit $rc
