"""Convert a GGUF file once into a Hugging Face safetensors folder in the cache.

transformers dequantizes the weights (the one slow step, 15-50 s for a 135M
model); the config is rebuilt from the header facts transformers' import drops
(:mod:`.gguf_checkpoint`). Every conversion goes to a temporary sibling folder
renamed into place at the end, so an interrupted one never leaves a partial
model and concurrent ones keep the first finished.

Cache root: ``$TRTLLM_DIFFKV_CACHE_DIR`` if set, else ``~/.cache/trtllm-diffkv``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import gguf_checkpoint
from .gguf_meta import read_gguf_metadata
from .llama import ModelConfig

CACHE_ENV = "TRTLLM_DIFFKV_CACHE_DIR"
GGUF_CONVERSION_VERSION = 2
"""Bumped when conversion output changes (2: RoPE scaling and stop ids from the GGUF header)."""
SOURCE_FILE = "trtllm_diffkv_source.json"
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # stored by some old Llama checkpoints


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[trtllm-diffkv] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$TRTLLM_DIFFKV_CACHE_DIR`` or ``~/.cache/trtllm-diffkv``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trtllm-diffkv").expanduser()


def converted_gguf_path(gguf: str | os.PathLike) -> Path:
    """Safetensors folder of a GGUF file, converting it on first use (see :func:`gguf_cache_path`).

    The header is checked first (:func:`gguf_checkpoint.hf_config`), so an
    unsupported architecture or RoPE scaling is refused before any weight is
    read, on every call, cached or not.

    Raises:
        ValueError: the header is unreadable or describes a model this
            package cannot run (naming what).
    """
    gguf = Path(gguf)
    gguf_checkpoint.hf_config(read_gguf_metadata(gguf))
    target = gguf_cache_path(gguf)
    if not (target / "config.json").is_file():
        log(f"converting {gguf.name} to safetensors in {target} (once)")
        convert_gguf(gguf, target)
    return target


def gguf_cache_path(gguf: str | os.PathLike) -> Path:
    """``<cache_root()>/models/gguf/<stem>-<key>``, ``key`` from path, size, mtime and converter version."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    ident = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|v{GGUF_CONVERSION_VERSION}"
    return cache_root() / "models" / "gguf" / f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def convert_gguf(gguf: str | os.PathLike, target: str | os.PathLike, name: str | None = None) -> Path:
    """Dequantize a GGUF checkpoint into a HF safetensors folder at ``target``.

    The header is validated before any weight is read. Writes ``config.json``
    (no ``quantization_config``; ``rope_scaling`` and ``eos_token_id`` from
    the GGUF header, which transformers' import drops), ``model.safetensors``
    (fp32; ``lm_head.weight`` dropped when tied), ``generation_config.json``
    (``eos_token_id``: every end-of-generation id), the tokenizer files (when
    the GGUF has a tokenizer) and ``trtllm_diffkv_source.json``. Everything
    goes to a temporary sibling folder first and is renamed to ``target`` at
    the end; on any error or interrupt the temporary folder is removed. If
    another process finished first, its result is kept.

    Args:
        gguf: the file.
        target: the folder to create.
        name: ``_name_or_path`` written to the config (default: the file's stem).

    Returns:
        ``target``.

    Raises:
        ValueError: the header describes a model this package cannot run.
        FileExistsError: ``target`` exists but is not a converted model.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, target = Path(gguf), Path(target)
    meta = read_gguf_metadata(gguf)
    header_config = gguf_checkpoint.hf_config(meta)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        log(f"dequantizing {gguf} with transformers")
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **_fp32_kwarg())
        log("writing safetensors, config and tokenizer")
        config = _converted_config(hf_model, header_config)
        config["_name_or_path"] = name or gguf.stem
        ModelConfig.from_hf_dict(config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        save_file(_hf_state_dict_for_saving(hf_model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_model.generation_config.eos_token_id = config["eos_token_id"]
        hf_model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        if "tokenizer.ggml.model" in meta.fields:
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
        source = {"gguf": str(gguf.resolve()), "gguf_bytes": gguf.stat().st_size,
                  "gguf_stop_token_ids": header_config["eos_token_id"],
                  "conversion_version": GGUF_CONVERSION_VERSION}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _publish(tmp, target)
        log(f"converted in {time.perf_counter() - start:.1f} s -> {target}")
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _converted_config(hf_model, header_config: dict) -> dict:
    """transformers' config of the dequantized model, with what its GGUF import drops put back.

    RoPE goes in the transformers<5 layout (``rope_theta`` + ``rope_scaling``)
    from the header; ``eos_token_id`` becomes the union of transformers' and
    the header's end-of-generation ids. A Gemma 3 file's sliding window, layer
    pattern, local RoPE base and attention scale come from the header too
    (:func:`~.gguf_checkpoint.hf_config`, llama.cpp's reading of the file).
    """
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("rope_parameters", None)
    config["architectures"] = [type(hf_model).__name__]
    config["rope_theta"] = header_config["rope_theta"]
    config["rope_scaling"] = header_config["rope_scaling"]
    for key in _GEMMA3_HEADER_KEYS:
        if key in header_config:
            config[key] = header_config[key]
    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    config["eos_token_id"] = sorted(eos | set(header_config["eos_token_id"]))
    return config


_GEMMA3_HEADER_KEYS = ("sliding_window", "layer_types", "rope_local_base_freq", "query_pre_attn_scalar")


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished temporary folder to ``target``; keep a concurrent winner's."""
    umask = os.umask(0)
    os.umask(umask)
    for file in tmp.iterdir():  # mkdtemp and some writers create owner-only files
        file.chmod(0o666 & ~umask)
    tmp.chmod(0o777 & ~umask)
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise FileExistsError(f"{target} exists but holds no converted model; remove it and retry") from None
        log(f"{target} was written concurrently; keeping it")


def _fp32_kwarg() -> dict:
    """``dtype=`` (transformers >= 4.56) or the older ``torch_dtype=``, set to fp32."""
    import transformers
    from packaging.version import Version

    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: torch.float32}


def _hf_state_dict_for_saving(hf_model) -> dict[str, torch.Tensor]:
    """Contiguous, unshared tensors; ``lm_head.weight`` dropped when tied."""
    state = hf_model.state_dict()
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: t.detach().contiguous() for name, t in state.items() if not name.endswith(IGNORED_TENSOR_SUFFIXES)}
