"""Convert a GGUF file once into a Hugging Face safetensors folder in the cache.

transformers dequantizes the weights (the one slow step, 15-50 s for a 135M
model); the config is rebuilt from the header facts transformers' import drops
(:mod:`.gguf_checkpoint`). Every conversion goes to a temporary sibling folder
renamed into place at the end, so an interrupted one never leaves a partial
model and concurrent ones keep the first finished.

Cache root: :func:`trtllm_diffkv.user_cache.cache_root`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import gguf_checkpoint
from .gguf_meta import read_gguf_metadata
from .llama import ModelConfig
from ..progress import heartbeat
from ..user_cache import cache_folder, cache_root

GGUF_CONVERSION_VERSION = 3
"""Bumped when conversion output changes (2: RoPE scaling and stop ids from the GGUF header; 3: the tokenizer
checked against the file's vocabulary, :func:`check_gguf_tokenizer`)."""
TOKENIZER_PROBES = (
    "The capital of France is Paris, and the function returns the number of values in the result.",
    "def count_values(values):\n    result = 0\n    for value in values:\n        result += value\n    return result\n",
)
"""Texts the converted tokenizer must read as the GGUF's vocabulary does (:func:`check_gguf_tokenizer`)."""
SOURCE_FILE = "trtllm_diffkv_source.json"
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # stored by some old Llama checkpoints


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[trtllm-diffkv] {msg}", file=sys.stderr, flush=True)


def converted_gguf_path(gguf: str | os.PathLike) -> Path:
    """Safetensors folder of a GGUF file, converting it on first use (see :func:`gguf_cache_path`).

    The header is checked first (:func:`gguf_checkpoint.hf_config`), so an
    unsupported architecture or RoPE scaling is refused before any weight is
    read, on every call, cached or not.

    Raises:
        ValueError: the header is unreadable or describes a model this
            package cannot run (naming what), or ``$TRTLLM_DIFFKV_CACHE_DIR`` is a relative path.
        OSError: the cache's ``models/gguf`` folder cannot be made or written (naming the variable to change).
    """
    gguf = Path(gguf)
    gguf_checkpoint.hf_config(read_gguf_metadata(gguf))
    target = gguf_cache_path(gguf)
    if not (target / "config.json").is_file():
        cache_folder("models", "gguf")  # a clear error naming the variable where it cannot be made or written
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
        with heartbeat("dequantizing the GGUF weights"):
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
            with heartbeat("building the tokenizer from the GGUF"):
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                check_gguf_tokenizer(tokenizer, gguf)
                tokenizer.save_pretrained(str(tmp))
        source = {"gguf": str(gguf.resolve()), "gguf_bytes": gguf.stat().st_size,
                  "gguf_stop_token_ids": header_config["eos_token_id"],
                  "conversion_version": GGUF_CONVERSION_VERSION}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _publish(tmp, target)
        log(f"converted in {time.perf_counter() - start:.1f} s -> {target}")
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_gguf_tokenizer(tokenizer, gguf: str | os.PathLike) -> None:
    """Refuse a tokenizer that transformers rebuilt from a GGUF file but that reads text otherwise than the file.

    transformers rebuilds a GGUF's tokenizer from the file's vocabulary; some versions rebuild some files wrong
    without an error (transformers 5.17 turns Gemma 3's SentencePiece BPE into a Unigram model that splits
    ``capital`` into ``c ap it al`` and adds no BOS; 5.25 rebuilds it right), and the model then reads
    garbage and writes garbage. Checked on :data:`TOKENIZER_PROBES`, against the file itself
    (``tokenizer.ggml.tokens``, ``tokenizer.ggml.add_bos_token``, ``tokenizer.ggml.bos_token_id``):

    * every id the tokenizer gives is a token of the file's vocabulary, named the same (a space and U+2581,
      SentencePiece's space mark, count as the same);
    * a word of the prose probe (after its first, between spaces, without punctuation: a SentencePiece
      vocabulary's merges may read ``result.`` otherwise) that is one token of the vocabulary (``▁word`` or
      ``Ġword``) is encoded as that token;
    * decoding the ids gives the probe back (or with one leading space, as SentencePiece's legacy decoders
      give it), where the vocabulary can spell each of its characters (as itself,
      U+2581 for a space, GPT-2's byte symbol or a ``<0xNN>`` byte token; a toy vocabulary may not);
    * where the file adds a BOS (``add_bos_token``; absent, llama.cpp adds one to a SentencePiece vocabulary),
      the tokenizer's encoding starts with it.

    Args:
        tokenizer: a transformers tokenizer (``__call__``, ``convert_ids_to_tokens``, ``decode``).
        gguf: the GGUF file it was built from.

    Raises:
        ValueError: the tokenizer fails a check; the message names the check, the probe, the transformers
            version and what to do.
    """
    import transformers

    meta = read_gguf_metadata(gguf, keep_arrays=("tokenizer.ggml.tokens",))
    vocab = meta.fields.get("tokenizer.ggml.tokens")
    if not isinstance(vocab, list) or not vocab:
        return
    token_ids = {token: i for i, token in enumerate(vocab)}
    where = (f"transformers {transformers.__version__} rebuilt the tokenizer of {Path(gguf).name} so that it reads "
             f"text otherwise than the file does")
    fix = ("the model would read garbage. Install a transformers version that rebuilds this file's tokenizer "
           "right (5.25 does for Gemma 3; 5.17 does not) and convert again")
    for probe in TOKENIZER_PROBES:
        ids = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        names = tokenizer.convert_ids_to_tokens(ids)
        for i, name in zip(ids, names):  # a SentencePiece file may store a space where the tokenizer has U+2581
            if not 0 <= i < len(vocab) or vocab[i].replace(" ", "\u2581") != name.replace(" ", "\u2581"):
                raise ValueError(f"{where}: id {i} is {name!r} for the tokenizer but "
                                 f"{vocab[i] if 0 <= i < len(vocab) else 'out of range'!r} in the file; {fix}")
        for word in dict.fromkeys(_spaced_words(probe) if probe is TOKENIZER_PROBES[0] else []):
            whole = [token_ids[t] for t in ("\u2581" + word, "\u0120" + word) if t in token_ids]
            if whole and not set(whole) & set(ids):
                raise ValueError(f"{where}: {word!r} is one token of the file's vocabulary (id {whole[0]}) but the "
                                 f"tokenizer splits {probe!r} into {names}; {fix}")
        decoded = tokenizer.decode(ids)  # SentencePiece's legacy decoders keep the prefix space: the ids are right
        if _spells(token_ids, probe) and decoded not in (probe, " " + probe):
            raise ValueError(f"{where}: {probe!r} decodes back as {decoded!r}; {fix}")
    bos = meta.fields.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece ("llama") vocabulary whose file does not say otherwise
    add_bos = meta.fields.get("tokenizer.ggml.add_bos_token", meta.fields.get("tokenizer.ggml.model") == "llama")
    if add_bos and bos is not None:
        first = list(tokenizer(TOKENIZER_PROBES[0])["input_ids"])[:1]
        if first != [bos]:
            raise ValueError(f"{where}: the file adds BOS (id {bos}) before every text but the tokenizer starts "
                             f"with {first}; {fix}")


def _spaced_words(text: str) -> list[str]:
    """The words of ``text`` after its first that stand between spaces, with no punctuation attached.

    Only these are sure to be read as their one vocabulary token where there is one: a SentencePiece
    vocabulary does not split punctuation off, and its merges may spell ``result.`` as ``▁res`` ``ult.``
    although ``▁result`` is a token.
    """
    return [word for word in text.split(" ")[1:] if re.fullmatch(r"[A-Za-z]+", word)]


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the symbols byte-level BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _spells(token_ids: dict[str, int], text: str) -> bool:
    """Whether a vocabulary holds every character of ``text`` as a token of its own, in some spelling."""
    symbols = _byte_symbols()
    for char in set(text):
        spellings = {char, char.replace(" ", "\u2581")}
        raw = char.encode()
        spellings.add("".join(symbols[b] for b in raw))
        if len(raw) == 1:
            spellings.add(f"<0x{raw[0]:02X}>")
        if not spellings & token_ids.keys():
            return False
    return True


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
