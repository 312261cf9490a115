"""Read a GGUF file's metadata without reading its weights.

The ``gguf`` package's ``GGUFReader`` parses every field, including the
~50k-entry token and merge arrays (seconds per call); this reader walks the
same header (GGUF v2/v3: magic, version, tensor count, key/value pairs, tensor
infos) and keeps long arrays only as their length, so a 100 MB file's
metadata reads in tens of milliseconds. It is what the loader uses to check
the architecture and RoPE scaling before any weight is dequantized, and to
read the file's own end-of-generation token ids on every run.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_KEEP_ARRAY_MAX = 4096  # longer arrays (token lists, merges) are kept as their length only
_GGML_F32, _GGML_F16 = 0, 1

EOG_TOKEN_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)
"""Metadata keys whose token ends generation (llama.cpp ``llama-vocab.cpp`` puts
each of these in its end-of-generation set)."""


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array too long to keep (a vocabulary); only its length is read."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry.

    Attributes:
        name: GGUF tensor name (``blk.0.attn_q.weight``, ``rope_freqs.weight``).
        shape: dims in PyTorch order (outermost first; GGUF stores them reversed).
        ggml_type: ``GGMLQuantizationType`` value (0 = F32, 1 = F16, ...).
        offset_bytes: absolute byte offset of the data in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset_bytes: int


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key/value metadata and tensor index (no tensor data).

    Attributes:
        path: the file.
        fields: key -> int, float, bool, str, list, or :class:`SkippedArray`.
        tensors: tensor name -> :class:`GGUFTensorInfo`, in file order.
    """

    path: Path
    fields: dict
    tensors: dict

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``"llama"``, ``"qwen2"``, ...); ``""`` if absent."""
        return str(self.fields.get("general.architecture", ""))

    def arch_field(self, suffix: str, default=None):
        """``fields[f"{architecture}.{suffix}"]`` or ``default``."""
        return self.fields.get(f"{self.architecture}.{suffix}", default)

    def read_f32_tensor(self, name: str) -> list[float]:
        """Values of a small F32/F16 tensor (e.g. ``rope_freqs.weight``), flattened.

        Raises:
            KeyError: no such tensor.
            ValueError: the tensor is quantized (not F32/F16).
        """
        info = self.tensors[name]
        count = 1
        for dim in info.shape:
            count *= dim
        if info.ggml_type not in (_GGML_F32, _GGML_F16):
            raise ValueError(f"{self.path.name}: tensor {name!r} has GGML type {info.ggml_type}; expected F32 or F16")
        fmt, size = ("<f", 4) if info.ggml_type == _GGML_F32 else ("<e", 2)
        with open(self.path, "rb") as f:
            f.seek(info.offset_bytes)
            data = f.read(count * size)
        return [v for (v,) in struct.iter_unpack(fmt, data)]


def read_gguf_metadata(path: str | os.PathLike, keep_arrays: tuple[str, ...] = ()) -> GGUFMetadata:
    """Parse the header of a GGUF v2/v3 file.

    Args:
        path: the file.
        keep_arrays: keys whose arrays are kept whole however long (``("tokenizer.ggml.tokens",)`` for the
            vocabulary); other arrays longer than 4096 items become a :class:`SkippedArray`.

    Raises:
        ValueError: not a GGUF file (bad magic), GGUF v1, or a truncated or
            malformed header (naming the file).
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise ValueError(f"{path}: not a GGUF file (empty)") from None
    with buf:
        try:
            return _parse(path, buf, frozenset(keep_arrays))
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: truncated or malformed GGUF header ({exc})") from None


def _parse(path: Path, buf, keep_arrays: frozenset = frozenset()) -> GGUFMetadata:
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    pos = 24
    fields = {}
    for _ in range(kv_count):
        key, pos = _string(buf, pos)
        (value_type,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        fields[key], pos = _value(buf, pos, value_type, key in keep_arrays)
    infos = []
    for _ in range(tensor_count):
        name, pos = _string(buf, pos)
        (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = {name: GGUFTensorInfo(name, shape, t, data_start + off) for name, shape, t, off in infos}
    return GGUFMetadata(path, fields, tensors)


def _string(buf, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    if pos + length > len(buf):
        raise IndexError("string runs past the end of the file")
    return bytes(buf[pos:pos + length]).decode("utf-8"), pos + length


def _value(buf, pos: int, value_type: int, keep: bool = False):
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _string(buf, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    item_type, length = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    skip = length > _KEEP_ARRAY_MAX and not keep
    if item_type in _SCALARS and skip:
        return SkippedArray(length), pos + length * struct.calcsize(_SCALARS[item_type])
    items = []
    for _ in range(length):
        if item_type == _STRING and skip:
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            continue
        item, pos = _value(buf, pos, item_type)
        items.append(item)
    return (SkippedArray(length) if skip else items), pos
