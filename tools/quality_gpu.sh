#!/usr/bin/env bash
# The full-size quality run on one GPU: SHARDS `trtllm-diffkv eval` processes over disjoint cases
# (`--shard I/SHARDS`, round-robin order), then one `--merge-details` into OUT_DIR/quality.json and
# OUT_DIR/quality_details.json. The reference-path eval is bound by Python and kernel-launch overhead
# (one token row per step and cache), not by the GPU, so processes side by side add throughput.
#
#   bash tools/quality_gpu.sh OUT_DIR SHARDS TIME_LIMIT_S [trtllm-diffkv eval arguments ...]
#
# Each shard starts no case after TIME_LIMIT_S (its --time-limit-s) and is stopped QUALITY_GPU_GRACE_S
# (120) later; it rewrites its files whole after every case, so a stopped shard keeps what it measured.
# Shard files and logs stay in
# $QUALITY_GPU_WORK (default /tmp/quality_gpu); OUT_DIR gets quality.json, quality_details.json and
# quality_gpu.log (every shard's log, the merge's output).
set -u -o pipefail
out=$1 shards=$2 limit=$3
shift 3
work=${QUALITY_GPU_WORK:-/tmp/quality_gpu}
mkdir -p "$out" "$work"
log="$out/quality_gpu.log"
: >"$log"
# Load once before the shards start: the first load of the default GGUF converts it (a cache in ~/.cache).
python3 -c "from trtllm_diffkv.model.loader import load_model; load_model(None)" >>"$log" 2>&1 || exit 1
pids=()
for i in $(seq 0 $((shards - 1))); do
    timeout "$((${limit%.*} + ${QUALITY_GPU_GRACE_S:-120}))" python3 -m trtllm_diffkv eval --shard "$i/$shards" --time-limit-s "$limit" --no-plot --no-progress \
        --output "$work/shard$i.json" "$@" >"$work/shard$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for i in $(seq 0 $((shards - 1))); do
    { echo "== shard $i/$shards"; tail -n 40 "$work/shard$i.log"; } >>"$log"
done
details=()
for i in $(seq 0 $((shards - 1))); do
    [ -f "$work/shard${i}_details.json" ] && details+=("$work/shard${i}_details.json")
done
[ ${#details[@]} -gt 0 ] || { echo "no shard wrote results" >>"$log"; exit 1; }
python3 -m trtllm_diffkv eval --merge-details "${details[@]}" --output "$out/quality.json" --no-plot >>"$log" 2>&1 || rc=1
exit $rc
