"""Engine directories written by ``trtllm-diffkv build`` (TensorRT-LLM's engine-dir layout) and read back.

Layout (``ENGINE_DIR/``)::

    config.json            TensorRT-LLM's engine config: "version", "pretrained_config",
                           "build_config" (max_batch_size, max_input_len, max_seq_len, max_beam_width,
                           max_num_tokens, "plugin_config" with "diffkv_plugin"), plus a "diffkv" section
                           (the DiffKVConfig fields, the engine shape, file names, what was built and
                           one line each on TensorRT and the CUDA C++ kernels: built, or why not)
    model/                 the model as a Hugging Face folder: config.json, model.safetensors (weights in
                           the build dtype), tokenizer and generation_config files copied from the checkpoint
    model.onnx (+ .data)   the graph with one DiffKV plugin node per layer (export/onnx_export.py); with
                           ``--graph per-op`` instead model_prefill.onnx + model_decode.onnx (per-operation plugin
                           nodes) sharing one model.onnx.data; ``--graph aot``: the same names, both graphs' DiffKV
                           work as standard ONNX operators and one node per kernel launch (TensorRT's AOT calling
                           convention)
    kernels/               AOT PTX + cubins for sm_80 / sm_90 and manifest.json (export/aot.py): the Triton kernels
                           and their TensorRT-convention wrappers (export/trt_abi.py: trt_abi.py + *.trt.*); the CUDA
                           C++ decode kernels where compiled (export/cuda_aot.py: cuda_kernels.json)
    rank0.engine           the serialized TensorRT engine, only where ``import tensorrt`` works

Directories are mode 0755 and files 0644, so that a server running as another user can read the directory.

:func:`read_engine_dir` gives what :class:`~trtllm_diffkv.llmapi.model_runner.ModelRunner` needs to run the
directory on the PyTorch executor: the model folder, the DiffKV config, the limits and dtype.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import DiffKVConfig
from .fields import kv_config_from_fields

ENGINE_FORMAT = "trtllm-diffkv-engine/1"


@dataclass(frozen=True)
class EngineDirInfo:
    """What an engine directory holds.

    Attributes:
        model_path: the Hugging Face model folder inside the engine dir.
        kv_config: the DiffKV configuration it was built for.
        max_batch_size: requests per step.
        max_seq_len: prompt + generated tokens per request.
        dtype: activation dtype (torch name: ``"float16"``, ``"bfloat16"``, ``"float32"``).
    """

    model_path: Path
    kv_config: DiffKVConfig
    max_batch_size: int
    max_seq_len: int
    dtype: str


def _config(path) -> dict | None:
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_engine_dir(path) -> bool:
    """Whether ``path`` is a directory written by ``trtllm-diffkv build`` (its config.json has the diffkv section)."""
    data = _config(path) if Path(path).is_dir() else None
    return bool(data) and isinstance(data.get("diffkv"), dict) and data["diffkv"].get("format") == ENGINE_FORMAT \
        and "build_config" in data


def read_engine_dir(path) -> EngineDirInfo:
    """Read an engine directory.

    Raises:
        ValueError: not an engine dir of this tool, or a config.json missing a key (naming it).
        FileNotFoundError: its model folder is missing.
    """
    if not is_engine_dir(path):
        raise ValueError(f"{path} is not an engine directory written by trtllm-diffkv build (no config.json with a "
                         "'diffkv' section)")
    data = _config(path)
    try:
        section, build = data["diffkv"], data["build_config"]
        model_path = Path(path) / section["model_dir"]
        info = EngineDirInfo(model_path, kv_config_from_fields(section["kv_config"]), int(build["max_batch_size"]),
                             int(build["max_seq_len"]), str(data["pretrained_config"]["dtype"]))
    except KeyError as exc:
        raise ValueError(f"{path}/config.json is missing {exc.args[0]!r}") from None
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: the engine's model folder {model_path} is missing")
    return info


_MODEL_KEYS = {"architecture": "architecture", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
               "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
               "num_key_value_heads": "num_kv_heads", "head_size": "head_dim", "rotary_scaling": "rope_scaling"}
"""``pretrained_config`` keys that must equal the model folder's (engine key -> ModelConfig attribute)."""


def check_engine_matches_model(path, model_config) -> None:
    """Refuse an engine dir whose ``config.json`` disagrees with the model it holds.

    Compares the ``pretrained_config`` keys the build wrote (architecture, vocabulary, layer and head
    counts, head size, RoPE scaling) with the loaded model folder's config, the ``dtype`` with the
    dtypes a build writes, and the ``diffkv.kv_config`` shape fields and ``build_config.max_seq_len``
    with the model.

    Raises:
        ValueError: naming the first key that disagrees, its value in config.json and the model's.
    """
    data = _config(path) or {}
    pretrained, build = data.get("pretrained_config") or {}, data.get("build_config") or {}
    for key, attr in _MODEL_KEYS.items():
        if key in pretrained and pretrained[key] != getattr(model_config, attr, pretrained[key]):
            raise ValueError(f"{path}/config.json: pretrained_config.{key}={pretrained[key]!r} disagrees with its "
                             f"model folder ({getattr(model_config, attr)!r})")
    if pretrained.get("dtype") not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{path}/config.json: pretrained_config.dtype={pretrained.get('dtype')!r} is not one of "
                         "float32, float16, bfloat16")
    fields = (data.get("diffkv") or {}).get("kv_config") or {}
    for key, attr in (("num_layers", "num_layers"), ("num_heads", "num_heads"), ("num_kv_heads", "num_kv_heads"),
                      ("head_dim", "head_dim")):
        if key in fields and fields[key] != getattr(model_config, attr):
            raise ValueError(f"{path}/config.json: diffkv.kv_config.{key}={fields[key]!r} disagrees with its model "
                             f"folder ({getattr(model_config, attr)!r})")
    from ..generation.prompts import position_limit

    limit = position_limit(model_config)
    if int(build.get("max_seq_len", 0)) > limit:
        raise ValueError(f"{path}/config.json: build_config.max_seq_len={build['max_seq_len']!r} exceeds the model's "
                         f"{limit} positions")


def engine_config(model_config, shape, *, onnx_file: str | dict | None, engine_file: str | None, targets: list[str],
                  tensorrt_note: str, graph: str | None = "composite", cuda_kernels: str | None = None,
                  cuda_kernels_note: str | None = None) -> dict:
    """The engine's config.json dict (TensorRT-LLM keys plus the ``diffkv`` section).

    Args:
        model_config: the :class:`~trtllm_diffkv.model.llama.ModelConfig`.
        shape: the :class:`~.fields.EngineShape`.
        onnx_file, engine_file: file names in the directory (``None``: not written); ``onnx_file`` of per-operation
            graphs: ``{"prefill": ..., "decode": ...}``.
        graph: the ONNX graph form (``"composite"``, ``"per-op"``, ``"aot"``; ``None``: no graph), recorded as
            ``diffkv.graph``.
        cuda_kernels: the CUDA C++ decode kernels' manifest in ``kernels/`` (``None``: not compiled).
        cuda_kernels_note: one line on them, recorded as ``diffkv.cuda_kernels_note``: what was compiled, or why
            they were not (as ``tensorrt_note`` for TensorRT).
        targets: AOT targets (``["sm_80", "sm_90"]``).
        tensorrt_note: what happened with TensorRT (built, or why not).
    """
    from .. import __version__

    mc = model_config
    pretrained = {
        "architecture": mc.architecture, "dtype": shape.dtype, "vocab_size": mc.vocab_size,
        "hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size,
        "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_heads,
        "num_key_value_heads": mc.num_kv_heads, "head_size": mc.head_dim, "hidden_act": "silu",
        "norm_epsilon": mc.rms_norm_eps, "position_embedding_type": "rope_gpt_neox", "rotary_base": mc.rope_theta,
        "rotary_scaling": mc.rope_scaling, "max_position_embeddings": mc.max_position_embeddings,
        "share_embedding_table": mc.tie_word_embeddings, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    build = {
        "max_batch_size": shape.max_batch_size, "max_input_len": shape.max_seq_len, "max_seq_len": shape.max_seq_len,
        "max_beam_width": 1, "max_num_tokens": shape.max_batch_size * shape.max_seq_len,
        "plugin_config": {"diffkv_plugin": shape.dtype, "gpt_attention_plugin": None, "paged_kv_cache": True,
                          "remove_input_padding": True, "context_fmha": False, "gemm_plugin": None},
    }
    diffkv = {
        "format": ENGINE_FORMAT, "trtllm_diffkv_version": __version__, "kv_config": shape.to_fields(),
        "model_dir": "model", "onnx": onnx_file, "graph": graph if onnx_file is not None else None,
        "onnx_data": None if onnx_file is None else "model.onnx.data", "engine": engine_file, "kernels_dir": "kernels",
        "aot_targets": targets, "cuda_kernels": cuda_kernels, "cuda_kernels_note": cuda_kernels_note,
        "plugin_namespace": "diffkv", "tensorrt": tensorrt_note,
    }
    return {"version": __version__, "pretrained_config": pretrained, "build_config": build, "diffkv": diffkv}
