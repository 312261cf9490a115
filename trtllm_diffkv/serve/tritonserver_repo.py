"""Write a Triton Inference Server model repository that serves a model with DiffKV (Python backend).

Layout (``write_repository``)::

    <repository>/<name>/config.pbtxt     backend "python", decoupled, tensors of tritonserver_requests
    <repository>/<name>/1/model.py       a copy of trtllm_diffkv/serve/tritonserver_model.py

``config.pbtxt`` declares ``max_batch_size`` (every tensor is ``[batch, ...]``, as in TensorRT-LLM's
own models, so their clients send the same shapes) but no ``dynamic_batching``: Triton hands each
request to the model as it arrives and the model's executor batches the requests of all clients
in flight. ``model_transaction_policy { decoupled: true }`` lets one request receive many
responses (streaming). One ``KIND_CPU`` instance: the instance owns the GPU through the LLM
(its ``device`` parameter), as TensorRT-LLM's ``llmapi`` model does. The ``parameters`` carry
the ``LLM`` arguments and ``python_path``, the directory of the ``trtllm_diffkv`` package that
wrote the repository (put first on the stub's ``sys.path``).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from .tritonserver_requests import INPUTS, OUTPUTS, TensorSpec

__all__ = ["model_config_text", "write_repository", "MODEL_TEMPLATE"]

MODEL_TEMPLATE = Path(__file__).with_name("tritonserver_model.py")
"""The Python backend model file copied into each repository."""

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _tensor(spec: TensorSpec, is_input: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    optional = "\n    optional: true" if is_input and spec.optional else ""
    return f'  {{\n    name: "{spec.name}"\n    data_type: {spec.data_type}\n    dims: [ {dims} ]{optional}\n  }}'


def _quote(value: str) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def model_config_text(name: str, *, max_batch_size: int = 64, decoupled: bool = True,
                      parameters: dict[str, str] | None = None) -> str:
    """The ``config.pbtxt`` of the DiffKV model (protobuf text format, Triton's ``ModelConfig``).

    Args:
        name: the model's name (the directory's name).
        max_batch_size: rows per request at most (Triton's ``max_batch_size``; >= 1). Requests of
            all clients are batched by the executor, whose own limit is the ``max_batch_size``
            parameter.
        decoupled: ``true``: any number of responses per request (streaming; served through
            gRPC streaming and HTTP ``generate``/``generate_stream``); ``false``: one response per
            request (HTTP/gRPC ``infer``, e.g. ``tritonclient.http``), requests executed one at a time.
        parameters: string parameters passed to the model (``model``, ``kv_config``, ...).

    Raises:
        ValueError: a name Triton would refuse, ``max_batch_size < 1``.
    """
    if not _NAME.match(name):
        raise ValueError(f"model name {name!r}: use letters, digits, '_', '-', '.' (not first)")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    inputs = ",\n".join(_tensor(spec, True) for spec in INPUTS)
    outputs = ",\n".join(_tensor(spec, False) for spec in OUTPUTS)
    params = "".join(f"parameters: {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}\n"
                     for key, value in sorted((parameters or {}).items()))
    return (f'# Written by trtllm-diffkv triton-repo. Tensors: trtllm_diffkv/serve/tritonserver_requests.py\n'
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
            f"model_transaction_policy {{\n  decoupled: {'true' if decoupled else 'false'}\n}}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: 1\n    kind: KIND_CPU\n  }}\n]\n{params}")


def write_repository(out: str | Path, *, model: str | Path | None = None, name: str = "trtllm_diffkv",
                     kv_config: str | None = None, max_batch_size: int = 64, kv_memory_bytes: int | None = None,
                     max_seq_len: int | None = None, device: str | None = None, dtype: str | None = None,
                     decoupled: bool = True, overwrite: bool = False, num_threads: int | None = None,
                     shutdown_timeout_s: float | None = None) -> Path:
    """Write ``out/<name>/config.pbtxt`` and ``out/<name>/1/model.py``.

    Args:
        out: the repository directory (created; other models in it are left alone).
        model: a checkpoint folder, ``.gguf`` or engine dir (made absolute); ``None`` = the default model.
        name: the Triton model name.
        kv_config: a DiffKV preset name (``trtllm_diffkv.config.PRESETS``) or a kv-config JSON file
            (``config.load_kv_config_file``; the model reads it from its absolute path); ``None``: an empty
            parameter, which the model passes to ``LLM`` as ``None`` (an engine dir's own configuration, else
            ``default``).
        max_batch_size: the executor's running batch limit, also Triton's rows per request limit.
        kv_memory_bytes: the KV pool's size in bytes (``None``: the LLM's default).
        max_seq_len: prompt + new tokens limit per request (``None``: the model's).
        device, dtype: the LLM's (``None``: CUDA if available, float32 on CPU / bfloat16 on GPU).
        decoupled: see :func:`model_config_text`.
        overwrite: replace an existing ``out/<name>``.
        num_threads: torch CPU threads in the model's stub process (``None``: torch's default).
        shutdown_timeout_s: at SIGTERM, seconds the requests in flight get before they are aborted
            (``None``: the model's default, 5 s); keep it below tritonserver's ``--exit-timeout-secs``.

    Returns:
        the model's directory.

    Raises:
        FileExistsError: ``out/<name>`` exists and not ``overwrite``.
        FileNotFoundError: ``model`` does not exist.
        ValueError: an unknown preset or dtype, a bad name or size.
    """
    from ..config import PRESETS, resolve_kv_config

    if kv_config is not None:
        resolve_kv_config(kv_config)  # an unknown preset or a bad file fails here, not in the server
        if kv_config not in PRESETS:  # a file: the server reads it by absolute path
            kv_config = str(Path(kv_config).resolve())
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: expected float32, float16 or bfloat16")
    if model is not None and not Path(model).exists():
        raise FileNotFoundError(f"model {model} does not exist")
    parameters = {"model": "" if model is None else str(Path(model).resolve()), "kv_config": kv_config or "",
                  "max_batch_size": str(max_batch_size), "kv_memory_bytes": str(kv_memory_bytes or ""),
                  "max_seq_len": str(max_seq_len or ""), "device": device or "", "dtype": dtype or "",
                  "num_threads": str(num_threads or ""),
                  "shutdown_timeout_s": "" if shutdown_timeout_s is None else str(float(shutdown_timeout_s)),
                  "python_path": str(Path(__file__).resolve().parents[2])}
    text = model_config_text(name, max_batch_size=max_batch_size, decoupled=decoupled, parameters=parameters)
    model_dir = Path(out) / name
    if model_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{model_dir} exists; pass --overwrite (Python: overwrite=True) to replace it")
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text)
    shutil.copyfile(MODEL_TEMPLATE, model_dir / "1" / "model.py")
    return model_dir
