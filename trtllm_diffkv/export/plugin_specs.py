"""DiffKV plugin descriptors in plain Python: inputs, shape and dtype inference, aliasing, plugin fields.

Three per-operation plugins (namespace ``diffkv``):

* ``diffkv::prefill_attention`` - scored prefill attention with prompt compaction into the pool
  (``paged/prefill.py``: scored prefill, prompt tiers, tokens quantized into the reserved pages);
* ``diffkv::decode_attention`` - the decode token written at high precision, then paged
  mixed-precision decode attention with the score update (``paged/decode.py``);
* ``diffkv::page_update`` - the decode-step page update: one ``append_decode`` of every row's tier
  deltas (``memory/triton_page_manager.py``);
* ``diffkv::decode_decide`` - the decode step's DiffKV tier decisions of every row
  (``kernels/decision_kernel.py::decide_rows``), the page update's deltas;
* ``diffkv::decode_locate`` - after the page update: the new tokens' high slots (the
  ``decode_attention`` nodes' plan tensors) and the moves to the low tier done in the pool
  (``decision_kernel.locate_rows``, then the write ops' ``read_tokens`` / ``write_tokens``).

``decode_decide -> page_update -> decode_locate`` is ``paged/decode.py::plan_device`` as three nodes (the
per-operation decode graph's plan, ``export/onnx_export.py``).

and the two composite plugins the exported ONNX graph is made of (``export/onnx_export.py``), which run
the paged cache's own per-layer code on a cache registered under a handle (:mod:`.plugin_ops`):

* ``diffkv::DiffKVPageUpdate`` - the step's page-manager plan (``PagedDiffKVCache.plan``: prompt
  reservation, decode decisions, one ``append_decode``, moves to the low tier);
* ``diffkv::DiffKVAttention`` - one layer's attention and KV handling (``PagedDiffKVCache.forward``:
  scored prefill with prompt compaction, paged decode attention with the score update).

The pool, page table and page-manager state are inputs updated in place: each such output is
*aliased* to its input (TensorRT ``IPluginV3OneBuildV2.getAliasedInput``; ``tensorrt.plugin``
``TensorDesc.aliased()``). The shape/dtype functions take dimension objects that support ``+ - * //``
(ints here; TensorRT's ``ShapeExpr`` entries in :mod:`.trt_plugins`), so the same code serves both.

Dtypes are strings: ``"float16" "bfloat16" "float32" "int32" "int64" "uint8" "bool"``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NAMESPACE = "diffkv"
VERSION = "1"
ACTIVATION_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class TensorSpec:
    """One plugin input: name, allowed dtypes, rank, and the input an output aliases (None: a new tensor)."""

    name: str
    dtypes: tuple[str, ...]
    rank: int


SHAPE_FIELDS = {"layer_idx": int, "num_layers": int, "num_heads": int, "num_kv_heads": int, "head_dim": int,
                "sm_scale": float}
"""Model-shape plugin fields (ONNX attributes: INT, and FLOAT for ``sm_scale``)."""
CONFIG_FIELDS = {"high_key_bits": int, "high_value_bits": int, "high_key_groups": int, "high_value_groups": int,
                 "low_key_bits": int, "low_value_bits": int, "low_key_groups": int, "low_value_groups": int,
                 "alpha_high": str, "alpha_low": str, "recent_window_tokens": int, "prompt_score_window_tokens": int,
                 "prompt_threshold_base": str, "center_keys": int, "compress": int, "key_rotation": str,
                 "rotation_seed": int, "score_pool_tokens": int, "kv_config_name": str}
"""The DiffKV configuration as plugin fields (``export/fields.py::kv_config_to_fields``; the thresholds as decimal
strings, since ONNX float attributes are fp32)."""
ATTENTION_FIELDS = {**SHAPE_FIELDS, **CONFIG_FIELDS}
MANAGER_FIELDS = {"num_layers": int, "num_kv_heads": int, "head_dim": int, **CONFIG_FIELDS}
RESERVED_ATTRIBUTES = ("plugin_namespace", "plugin_version")
"""ONNX attributes TensorRT's ONNX parser reads to find the plugin (not plugin fields)."""


@dataclass(frozen=True)
class PluginSpec:
    """A plugin: ``namespace::name`` (version :data:`VERSION`), its inputs, which outputs alias which inputs
    (in place), and its fields (``{name: int | float | str}``: TensorRT plugin fields, ONNX attributes).

    An output that aliases no input takes the shape and dtype ``new_outputs`` gives it (``{output index: (dtype,
    shape function)}``, the function called as ``f(input shapes, fields)`` with dims that support ``+ - * //``),
    else the first input's (the attention output: q's; the page update's step token: the cache handle's, int64
    ``[1]``)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    aliases: dict
    fields: dict
    new_outputs: dict = field(default_factory=dict)

    @property
    def full_name(self) -> str:
        """``"diffkv::<name>"``: the TensorRT plugin id (namespace::name)."""
        return f"{NAMESPACE}::{self.name}"

    def check(self, dtypes: list[str], ranks: list[int]) -> None:
        """Raise ``ValueError`` naming the first input whose dtype or rank is not accepted."""
        if len(dtypes) != len(self.inputs):
            raise ValueError(f"{self.full_name}: {len(dtypes)} inputs, expected {len(self.inputs)} "
                             f"({[t.name for t in self.inputs]})")
        for spec, dtype, rank in zip(self.inputs, dtypes, ranks):
            if dtype not in spec.dtypes:
                raise ValueError(f"{self.full_name}: input {spec.name} is {dtype}, expected one of {list(spec.dtypes)}")
            if rank != spec.rank:
                raise ValueError(f"{self.full_name}: input {spec.name} has rank {rank}, expected {spec.rank}")


_ACT = ACTIVATION_DTYPES
_STATE = (TensorSpec("kv_pool", ("uint8",), 2), TensorSpec("page_table", ("int32",), 2),
          TensorSpec("tier_tokens", ("int32",), 2))

_INT = ("int32", "int64")

PREFILL = PluginSpec(
    "prefill_attention",
    (TensorSpec("q", _ACT, 3), TensorSpec("k", _ACT, 3), TensorSpec("v", _ACT, 3),
     TensorSpec("cu_seqlens", ("int32",), 1), TensorSpec("req", _INT, 1), TensorSpec("token_index", _INT, 1),
     TensorSpec("score_count", ("float32",), 1), TensorSpec("thr_high", ("float32", "float64"), 1),
     TensorSpec("thr_low", ("float32", "float64"), 1), TensorSpec("window", ("bool",), 1),
     TensorSpec("start", _INT, 1), TensorSpec("row_base", _INT, 1), TensorSpec("reserved_pages", _INT, 1),
     TensorSpec("err_idx", ("int32",), 1), *_STATE, TensorSpec("key_offsets", ("float16",), 2),
     TensorSpec("tier_counts", ("int32",), 4), TensorSpec("error_flags", ("int32",), 1)),
    ("out", "kv_pool", "key_offsets", "tier_counts", "error_flags"),
    {1: 14, 2: 17, 3: 18, 4: 19},
    ATTENTION_FIELDS,
)
"""Inputs: q ``[T, H, D]``, k/v ``[T, Hkv, D]``, cu_seqlens ``[B + 1]``, then the per-token tensors of the
step's plan (``paged/prefill.py::plan_prefill``: request index, index in its prompt, scoring-query count,
high / low thresholds, recent-window flag, the request's first token, its first page-table row, its reserved
pages) and ``err_idx [T * Hkv]``; the state; key_offsets fp16 ``[rows, D]``; tier_counts int32 ``[B, L, Hkv, 2]``;
error_flags ``[slots]``. Outputs: out ``[T, H, D]`` (q's dtype), then the pool, key offsets, counts and flags
in place."""

DECODE = PluginSpec(
    "decode_attention",
    (TensorSpec("q", _ACT, 3), TensorSpec("k", _ACT, 3), TensorSpec("v", _ACT, 3), TensorSpec("row_ids", ("int32",), 2),
     TensorSpec("dest_page", _INT, 1), TensorSpec("dest_slot", _INT, 1), TensorSpec("positions", ("int32",), 1),
     TensorSpec("err_idx", ("int32",), 1), *_STATE, TensorSpec("key_offsets", ("float16",), 2),
     TensorSpec("error_flags", ("int32",), 1)),
    ("out", "kv_pool", "error_flags"),
    {1: 8, 2: 12},
    ATTENTION_FIELDS,
)
"""Inputs: q ``[B, H, D]``, k/v ``[B, Hkv, D]`` (the new token), row_ids ``[B, Hkv]``, dest_page / dest_slot
``[B * Hkv]`` (the high slot the step's plan chose, ``paged/decode.py::plan_decode``), positions and err_idx
``[B * Hkv]``, the state, key_offsets, error_flags. Outputs: out ``[B, H, D]``, the pool (new tokens,
scores) and the error flags in place."""

PAGE_UPDATE = PluginSpec(
    "page_update",
    (TensorSpec("slots", ("int64",), 1), TensorSpec("high_delta", ("int32",), 3), TensorSpec("low_delta", ("int32",), 3),
     TensorSpec("page_table", ("int32",), 2), TensorSpec("tier_tokens", ("int32",), 2),
     TensorSpec("row_pages", ("int32",), 2), TensorSpec("slot_state", ("int32",), 1), TensorSpec("ring", ("int32",), 1),
     TensorSpec("ring_state", ("int64",), 1)),
    ("page_table", "tier_tokens", "row_pages", "slot_state", "ring", "ring_state"),
    {0: 3, 1: 4, 2: 5, 3: 6, 4: 7, 5: 8},
    MANAGER_FIELDS,
)
"""Inputs: slots ``[n]``, high/low deltas ``[n, L, Hkv]`` in {0, 1}, then the page manager's state
(``TritonPageManager``: page_table, tokens, pages, slot_state, ring, ring_state); every output is its input, in place."""

_I64 = lambda name: TensorSpec(name, ("int64",), 1)  # noqa: E731


def _items(shapes, f):
    """``[n * L * Hkv]``: one item per (sequence, layer, KV head) row of the step's ``n`` sequences."""
    return (shapes[0][0] * (f["num_layers"] * f["num_kv_heads"]),)


def _per_head(shapes, f):
    """``[n, L, Hkv]``: the page update's delta layout."""
    return (shapes[0][0], f["num_layers"], f["num_kv_heads"])


DECODE_DECIDE = PluginSpec(
    "decode_decide",
    (_I64("slots"), _I64("positions"), *_STATE, _I64("prompt_len")),
    ("high_delta", "low_delta", "new_index", "move_from", "move_to"),
    {},
    MANAGER_FIELDS,
    {0: ("int32", _per_head), 1: ("int32", _per_head), 2: ("int64", _items), 3: ("int64", _items),
     4: ("int64", _items)},
)
"""The decode step's DiffKV decisions (``kernels/decision_kernel.py::decide_rows``, one ``_decide_kernel`` launch).
Inputs: slots int64 ``[n]`` (the decode sequences' slots), positions int64 ``[n]`` (the position each writes = its
tokens stored), the state before the step (kv_pool: scores and positions; page_table; tier_tokens), prompt_len
int64 ``[max_slots]``. Outputs (new): high_delta / low_delta int32 ``[n, L, Hkv]`` (the page update's deltas),
new_index / move_from / move_to int64 ``[n * L * Hkv]`` (``paged/decisions.py::StepActions``). Nothing in place;
the alphas come from the fields (an fp64 buffer of the plugin: TensorRT has no fp64 tensors)."""


def _layer_major(shapes, f):
    """``[L, B, Hkv]`` with ``B`` = the step's tokens (``token_positions``: sequences plus padding)."""
    return (f["num_layers"], shapes[2][0], f["num_kv_heads"])


def _layer_heads(shapes, f):
    return (f["num_layers"], shapes[2][0] * f["num_kv_heads"])


def _heads(shapes, f):
    return (shapes[2][0] * f["num_kv_heads"],)


DECODE_LOCATE = PluginSpec(
    "decode_locate",
    (_I64("slots"), _I64("positions"), _I64("token_positions"), _I64("new_index"), _I64("move_from"),
     _I64("move_to"), TensorSpec("page_table", ("int32",), 2), TensorSpec("kv_pool", ("uint8",), 2)),
    ("kv_pool", "row_ids", "dest_page", "dest_slot", "decode_positions", "err_idx"),
    {0: 7},
    MANAGER_FIELDS,
    {1: ("int32", _layer_major), 2: ("int32", _layer_heads), 3: ("int32", _layer_heads), 4: ("int32", _heads),
     5: ("int32", _heads)},
)
"""After the page update (``decision_kernel.locate_rows``, one ``_locate_kernel`` launch, then the moves: the
write ops' ``read_tokens`` high / ``write_tokens`` low, ``paged/decode.py::plan_device``). Inputs: slots, positions
(as :data:`DECODE_DECIDE`), token_positions int64 ``[B]`` (the step's token positions; only its length ``B >= n``,
the bucket, is read: sequences ``b >= n`` are padding), the decisions' new_index / move_from / move_to, the page
table after the page update, kv_pool. Outputs: kv_pool in place (every move dequantized from its high slot and
requantized into its low slot), then the ``decode_attention`` nodes' plan tensors: row_ids int32 ``[L, B, Hkv]``,
dest_page / dest_slot int32 ``[L, B * Hkv]``, decode_positions and err_idx int32 ``[B * Hkv]`` (padding: row id
and page -1)."""

_HANDLE = TensorSpec("cache_handle", ("int64",), 1)

STEP_PAGE_UPDATE = PluginSpec(
    "DiffKVPageUpdate",
    (_HANDLE, TensorSpec("step_slots", ("int64",), 1), TensorSpec("step_seq_lens", ("int64",), 1),
     TensorSpec("step_positions", ("int64",), 1), TensorSpec("step_is_prefill", ("bool",), 1), *_STATE[1:]),
    ("step_token", "page_table", "tier_tokens"),
    {1: 5, 2: 6},
    MANAGER_FIELDS,
)
"""Composite (the ONNX graph's): cache_handle int64 ``[1]``, the step (slots, sequence lengths, first positions,
prefill flags, ``[num_requests]``), page_table, tier_tokens. Outputs: step_token int64 ``[1]`` (1: planned),
page_table and tier_tokens in place."""

LAYER_ATTENTION = PluginSpec(
    "DiffKVAttention",
    (TensorSpec("q", _ACT, 3), TensorSpec("k", _ACT, 3), TensorSpec("v", _ACT, 3), *_STATE, _HANDLE,
     TensorSpec("step_token", ("int64",), 1)),
    ("out", "kv_pool", "page_table", "tier_tokens"),
    {1: 3, 2: 4, 3: 5},
    ATTENTION_FIELDS,
)
"""Composite (the ONNX graph's): q ``[T, H, D]``, k/v ``[T, Hkv, D]``, the state (kv_pool, page_table,
tier_tokens), cache_handle, step_token (the page update's: orders the node after it). Outputs: out ``[T, H, D]``
(q's dtype), the state in place."""

PLAN_KERNELS = {
    "decode_decide": (("_decide_kernel", "decode_plan"),),
    "page_update": (("_count_kernel", "page_manager"), ("_scan_kernel", "page_manager"),
                    ("_decode_apply_kernel", "page_manager")),
    "decode_locate": (("_locate_kernel", "decode_plan"), ("_read_tokens_kernel", "read_high_move"),
                      ("_write_tokens_kernel", "write_low_move")),
}
"""The AOT kernels (manifest ``(kernel function, op)``, ``export/aot.py``) each decode-plan plugin launches, in order:
``page_update`` runs ``_scan_kernel`` only when its block sums exceed one chunk (the manifest's ``select``);
``decode_locate``'s two move kernels only for a tiered preset (fp16 and the uniform formats move nothing)."""

PLUGINS = {p.full_name: p for p in (PREFILL, DECODE, PAGE_UPDATE, DECODE_DECIDE, DECODE_LOCATE, STEP_PAGE_UPDATE,
                                    LAYER_ATTENTION)}
"""Every DiffKV plugin, by ``namespace::name``: what ``trt_plugins`` registers and the ONNX export may use."""


def infer(plugin: PluginSpec, shapes: list[tuple], dtypes: list[str], fields: dict | None = None) -> list[tuple[tuple, str]]:
    """Output ``(shape, dtype)`` of ``plugin`` for inputs of these shapes (dims: ints or shape expressions).

    Args:
        plugin: the plugin; shapes, dtypes: its inputs', in order.
        fields: the plugin fields (the node's attributes); needed by plugins with ``new_outputs`` (the decode plan's
            ``decode_decide`` / ``decode_locate``, whose outputs are sized by ``num_layers`` and ``num_kv_heads``).

    Raises:
        ValueError: an input of a wrong dtype or rank, (for integer dims) q/k/v that disagree, or no ``fields``
            for a plugin that needs them.
    """
    plugin.check(dtypes, [len(s) for s in shapes])
    if plugin.new_outputs and fields is None:
        raise ValueError(f"{plugin.full_name}: output shapes need the plugin fields (num_layers, num_kv_heads)")
    out = []
    for j, name in enumerate(plugin.outputs):
        if j in plugin.aliases:
            i = plugin.aliases[j]
            out.append((tuple(shapes[i]), dtypes[i]))
        elif j in plugin.new_outputs:
            dtype, shape = plugin.new_outputs[j]
            out.append((tuple(shape(shapes, fields)), dtype))
        else:  # the attention output: q's shape and dtype
            out.append((tuple(shapes[0]), dtypes[0]))
    if plugin.inputs[0].name == "q":
        q, k, v = shapes[:3]
        if all(isinstance(d, int) for d in (*q, *k, *v)):
            if k != v or q[0] != k[0] or q[2] != k[2] or q[1] % k[1]:
                raise ValueError(f"{plugin.full_name}: q {tuple(q)}, k {tuple(k)}, v {tuple(v)} disagree "
                                 "(tokens, head_dim, or heads not a multiple of KV heads)")
    return out


# --------------------------------------------------------------------------- plugin fields

FIELD_KINDS = {"int": np.int64, "float": np.float64, "str": np.bytes_}


def to_plugin_fields(fields: dict) -> list[tuple[str, np.ndarray, str]]:
    """``[(name, 1-element numpy array, kind)]`` for TensorRT ``PluginField``s (kind: int -> INT64,
    float -> FLOAT64, str -> CHAR). Floats stay float64 (ONNX attributes would round them to fp32)."""
    out = []
    for name, value in fields.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int):
            out.append((name, np.array([value], dtype=np.int64), "int"))
        elif isinstance(value, float):
            out.append((name, np.array([value], dtype=np.float64), "float"))
        elif isinstance(value, str):
            out.append((name, np.frombuffer(value.encode(), dtype=np.int8).copy(), "str"))
        else:
            raise TypeError(f"plugin field {name!r}: {type(value).__name__} is not int, float or str")
    return out


def from_plugin_fields(items: list[tuple[str, np.ndarray, str]]) -> dict:
    """Inverse of :func:`to_plugin_fields`."""
    out = {}
    for name, array, kind in items:
        if kind == "str":
            out[name] = np.asarray(array, dtype=np.int8).tobytes().decode()
        elif kind == "int":
            out[name] = int(np.asarray(array).reshape(-1)[0])
        elif kind == "float":
            out[name] = float(np.asarray(array).reshape(-1)[0])
        else:
            raise ValueError(f"plugin field {name!r}: unknown kind {kind!r}")
    return out


def select_kernel(manifest: dict, kernel: str, sizes: dict, op: str | None = None) -> dict:
    """The manifest entry of ``kernel`` (e.g. ``"_prompt_lse_kernel"``) whose ``select`` condition holds for
    ``sizes`` (e.g. ``{"max_len": 700}``); ``op`` narrows the write kernels (``"write_high"``...).

    Raises:
        LookupError: no entry (naming the kernel and sizes), or more than one.
    """
    found = []
    for entry in manifest["kernels"]:
        if entry["kernel"].split(":")[1] != kernel or (op is not None and entry["op"] != op):
            continue
        cond = entry.get("select")
        names = {**{k: v for k, v in entry["constexprs"].items() if isinstance(v, int)}, **sizes}
        if cond is None or eval(cond, {"__builtins__": {}}, names):  # noqa: S307 - the manifest's own conditions
            found.append(entry)
    if len(found) != 1:
        raise LookupError(f"{len(found)} manifest entries of {kernel} (op {op}) for {sizes}")
    return found[0]
