"""``trtllm-diffkv build``: the ``trtllm-build --plugin diffkv`` surface; writes an engine directory.

::

    trtllm-diffkv build --checkpoint DIR --output ENGINE_DIR --plugin diffkv [--kv-config PRESET|FILE]
                        [--max-batch-size N] [--max-seq-len N] [--dtype auto|float16|bfloat16|float32]
                        [--targets 80,90] [--no-onnx] [--graph composite|per-op|aot]

Steps (:func:`build_engine_dir`): load and check the checkpoint; fix the engine shape
(:class:`~trtllm_diffkv.export.fields.EngineShape`: refuses an unsupported head_dim or query:KV ratio);
write the model folder (weights as safetensors in the build dtype), the ONNX graph with one DiffKV
plugin node per layer (``--graph composite``, the default: ``model.onnx``; ``--graph per-op``: the per-operation
graphs ``model_prefill.onnx`` and ``model_decode.onnx``, whose weights are one shared ``model.onnx.data``;
``--graph aot``: the AOT prefill and decode graphs - standard ONNX operators and one node per kernel launch in
TensorRT's AOT calling convention, ``export/onnx_export.py::export_aot`` / ``export_aot_prefill`` - which need a float32
build, the graphs' activations: ``--dtype float32``, or ``auto`` on a float32 checkpoint), the AOT Triton kernels for
``--targets`` with their TensorRT-convention wrappers and the manifest (``kernels/manifest.json``), the CUDA C++ decode
kernels in that convention where the engine's configuration has them and ``nvcc`` is present
(``kernels/cuda_kernels.json``; else one line says why not, also recorded as ``diffkv.cuda_kernels_note``), and
config.json (:mod:`trtllm_diffkv.export.engine_dir`). Where ``import tensorrt`` works it would also parse the composite
ONNX graph with the DiffKV plugins registered and serialize ``rank0.engine``; where not (this project's machines), it
prints one line saying so. Serialized engines of the per-operation and AOT graphs are not built by this command (one
line says so, and whether TensorRT is importable). Everything is written into a temporary sibling directory whose
permissions are then set to directories 0755, files 0644 (``tempfile.mkdtemp`` makes it 0700: a server running as
another user could not read it) and that is renamed to ``ENGINE_DIR`` at the end, so a failed build leaves nothing
behind. Errors are one line on stderr, exit code 2.

Progress: one tqdm bar on stderr advancing stage by stage (:data:`STAGES`: the current stage's name, stages done
of all, elapsed time), plus the one-line notes; when stderr is not a terminal, one line per stage and a line
every 10 s while a stage runs instead of the bar; ``--quiet`` turns off all of it (errors and the final line
stay).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

from .common import refuse_tp


STAGES = ("load the checkpoint", "write the model folder", "export the ONNX graph", "compile the Triton kernels",
          "compile the CUDA kernels", "export the ONNX graphs", "build the TensorRT engine", "write config.json")
"""The build's stages in order (:func:`build_engine_dir` announces each through ``stage``; the ONNX stages only
run when their graph is asked for)."""

PLUGIN_ENTRY_POINTS = "trtllm_diffkv.plugins"
"""Entry-point group of the packages that register an engine's TensorRT plugins: ``--plugin NAME`` loads the entry
point ``NAME`` (``diffkv``: ``trtllm_diffkv_plugins:register``, declared by pyproject.toml and installed from the folder
``plugins/``). ``trtllm_diffkv`` never imports the plugin package itself."""

_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
           "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def add_parser(subparsers) -> None:
    """Register ``build`` (``parser.set_defaults(run=run)``)."""
    from ..config import PRESETS

    p = subparsers.add_parser("build", help="build a DiffKV engine directory (trtllm-build --plugin diffkv)")
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint folder or .gguf file")
    p.add_argument("--output", required=True, help="engine directory to create (must not exist)")
    p.add_argument("--plugin", required=True, help="the attention plugin; only 'diffkv'")
    p.add_argument("--kv-config", default="default", metavar="PRESET|FILE",
                   help=f"DiffKV preset ({', '.join(sorted(PRESETS))}) or a kv-config JSON file written by "
                        "`trtllm-diffkv calibrate` (default: default)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests per step (default: 8)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: only 1 (engine dirs are not split; "
                   "use serve --tp on the checkpoint)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="prompt + generated tokens (default: 2048)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"),
                   help="activation dtype (default: auto = the checkpoint's)")
    p.add_argument("--targets", default="80,90", help="GPU compute capabilities to compile for (default: 80,90)")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX graph (default: write it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no notes (the bar is also off when "
                                                        "stderr is not a terminal)")
    # the choices are listed in the help, not given to argparse: a bad value is this command's one-line error
    # (build_engine_dir checks it against EXPORT_GRAPHS, which export/__init__.py holds free of imports)
    from ..export import EXPORT_GRAPHS

    p.add_argument("--graph", default="composite", metavar="{" + ",".join(EXPORT_GRAPHS) + "}",
                   help="ONNX graph form, one of " + ", ".join(EXPORT_GRAPHS) + ": 'composite' (model.onnx, the "
                        "default), 'per-op' (model_prefill.onnx + model_decode.onnx: per-operation plugin nodes, the "
                        "decode graph plans its own steps) or 'aot' (prefill and decode graphs of standard ONNX "
                        "operators and one node per kernel launch; needs a float32 build: --dtype float32, or auto "
                        "on a float32 checkpoint)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Build; 0 on success, 2 on a bad argument or a failed build (one line on stderr)."""
    quiet = getattr(args, "quiet", False)
    bar = StageBar(_stage_count(not args.no_onnx, args.graph), quiet=quiet)
    try:
        refuse_tp(args.tp, "build")
        out = build_engine_dir(args.checkpoint, args.output, plugin=args.plugin, kv_config=args.kv_config,
                               max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, dtype=args.dtype,
                               targets=_targets(args.targets), onnx=not args.no_onnx, graph=args.graph,
                               log=(lambda line: None) if quiet else bar.write, stage=bar.stage)
    except Exception as exc:  # noqa: BLE001 - every failure is one line
        bar.close()
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"trtllm-diffkv build: error: {msg}", file=sys.stderr)
        return 2
    bar.close()
    print(f"engine directory written: {out}")
    return 0


def _stage_count(onnx: bool, graph: str) -> int:
    return len(STAGES) - 2 + (1 if onnx else 0)  # one of the two ONNX stages, or none


class StageBar:
    """A tqdm bar over the build's stages on ``file`` (default stderr): ``stage(name)`` finishes the stage before
    and shows ``name``; ``write(line)`` prints a note above the bar (``[trtllm-diffkv build] line``).

    When ``file`` is not a terminal (a log, CI) or tqdm is missing there is no bar: each stage prints one line
    (``[trtllm-diffkv build] stage 3/7: name``) and, while it runs, a line every
    :data:`~trtllm_diffkv.progress.HEARTBEAT_S` seconds (:class:`~trtllm_diffkv.progress.Heartbeat`), so no stage
    is silent for minutes. ``quiet``: nothing but the notes' absence (errors and the final line stay).
    """

    def __init__(self, total: int, *, quiet: bool = False, file=None):
        from .. import progress

        self.file = file if file is not None else sys.stderr
        self.bar, self.started, self.total, self.done = None, False, total, 0
        self.heartbeat = None
        is_tty = getattr(self.file, "isatty", lambda: False)()
        if quiet:
            return
        if is_tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, file=self.file, unit="stage", dynamic_ncols=True,
                                bar_format="{desc} {n_fmt}/{total_fmt} stages |{bar}| {elapsed}")
                return
        self.heartbeat = progress.Heartbeat("[trtllm-diffkv build]", progress.HEARTBEAT_S, self.file)

    def stage(self, name: str) -> None:
        if self.heartbeat is not None:
            self.done += 1
            print(f"[trtllm-diffkv build] stage {self.done}/{self.total}: {name}", file=self.file, flush=True)
            self.heartbeat.start(name)
            return
        if self.bar is None:
            return
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description_str(f"[build] {name}")

    def write(self, line: str) -> None:
        text = f"[trtllm-diffkv build] {line}"
        if self.bar is not None:
            self.bar.write(text, file=self.file)
        else:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.bar is not None:
            if self.started:
                self.bar.update(1)
            self.bar.close()
            self.bar = None


def _targets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t.strip().removeprefix("sm_")) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--targets {text!r}: give compute capabilities such as 80,90") from None


def build_engine_dir(checkpoint, output, *, plugin: str = "diffkv", kv_config: str = "default",
                     max_batch_size: int = 8, max_seq_len: int = 2048, dtype: str = "auto",
                     targets: tuple[int, ...] = (80, 90), onnx: bool = True, graph: str = "composite",
                     log=lambda line: None, stage=lambda name: None) -> Path:
    """Write an engine directory (see the module docstring); returns its path.

    Args:
        log: gets the one-line notes (what a stage did or why it did not run).
        stage: gets each stage's name of :data:`STAGES` as it starts (a progress bar: :class:`StageBar`).
        graph: ``"composite"`` (``model.onnx``), ``"per-op"`` (``model_prefill.onnx`` + ``model_decode.onnx``, one
            shared ``model.onnx.data``) or ``"aot"`` (as ``"per-op"``, the graphs' DiffKV work as kernel launches;
            needs a float32 build: ``dtype="float32"``, or ``"auto"`` on a float32 checkpoint); the last two need
            ``onnx=True``.

    Raises:
        ValueError: ``plugin`` other than ``diffkv``, an unsupported head_dim / architecture / GPU
            target / dtype / size, an existing ``output``, an unknown ``graph``, ``per-op`` / ``aot`` without
            ONNX, or ``aot`` on a build dtype other than float32.
        FileNotFoundError: a missing checkpoint.
        RuntimeError: a kernel failed to compile.
    """
    import torch

    from ..export import aot
    from ..export.engine_dir import engine_config
    from ..export.fields import EngineShape
    from ..config import resolve_kv_config
    from ..model.loader import load_model, resolve_model_path

    if plugin != "diffkv":
        raise ValueError(f"--plugin {plugin!r} is not supported; the only plugin is 'diffkv'")
    from ..export import EXPORT_GRAPHS

    if graph not in EXPORT_GRAPHS:
        raise ValueError(f"--graph {graph!r}: expected one of {', '.join(EXPORT_GRAPHS)}")
    if graph != "composite" and not onnx:
        raise ValueError(f"--graph {graph} writes ONNX graphs; it cannot be combined with --no-onnx")
    aot.check_targets(targets)
    checkpoint, output = Path(checkpoint), Path(output)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if output.exists():
        raise ValueError(f"output {output} already exists; choose a new directory")
    kv = resolve_kv_config(kv_config)
    stage(STAGES[0])
    model, _, mc = load_model(str(checkpoint), device="cpu", dtype=None if dtype == "auto" else getattr(torch, dtype))
    from ..generation.prompts import position_limit

    limit = position_limit(mc)
    if max_seq_len > limit:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's {limit} positions")
    dtype_name = str(model.dtype).removeprefix("torch.")
    if graph == "aot" and dtype_name != "float32":
        raise ValueError(f"--graph aot: the AOT graphs' activations are float32 and their kernels are compiled "
                         f"for them; it needs a float32 build (--dtype float32, or auto on a float32 checkpoint); "
                         f"this build: {dtype_name}")
    shape = EngineShape(num_layers=mc.num_layers, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                        head_dim=mc.head_dim, kv_config=kv, dtype=dtype_name, max_batch_size=max_batch_size,
                        max_seq_len=max_seq_len)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        stage(STAGES[1])
        _write_model(model, resolve_model_path(str(checkpoint)), tmp / "model")
        from ..model.rotation import model_for_kv_config

        model = model_for_kv_config(model, kv, in_place=True)  # written unrotated above; the graphs take it rotated
        onnx_file = None
        if onnx and graph == "composite":
            stage(STAGES[2])
            log("exporting the ONNX graph with DiffKV plugin nodes")
            from ..export.onnx_export import export_onnx

            proto = export_onnx(model, kv, max_positions=max_seq_len)
            _save_onnx(proto, tmp / "model.onnx")
            onnx_file = "model.onnx"
        stage(STAGES[3])
        log(f"compiling the kernels ahead of time for {', '.join(f'sm_{t}' for t in targets)}")
        manifest = aot.build_kernels(shape, tmp / "kernels", targets)
        stage(STAGES[4])
        cuda_kernels, cuda_note = _cuda_kernels(shape, tmp / "kernels", targets)
        log(cuda_note)
        if onnx and graph != "composite":
            stage(STAGES[5])
            log(f"exporting the {graph} ONNX graphs (prefill, decode) with DiffKV plugin nodes")
            from ..export.onnx_export import PHASES, export_onnx

            extra = dict(manifest=manifest, target=f"sm_{max(targets)}") if graph == "aot" else {}
            protos = {ph: export_onnx(model, kv, max_positions=max_seq_len, graph=graph, phase=ph, **extra)
                      for ph in PHASES}
            onnx_file = {ph: f"model_{ph}.onnx" for ph in PHASES}
            _save_shared_onnx(protos, tmp, onnx_file, "model.onnx.data")
        stage(STAGES[6])
        engine_file, note = _tensorrt_engine(tmp, onnx_file, graph)
        log(note)
        stage(STAGES[7])
        config = engine_config(mc, shape, onnx_file=onnx_file, engine_file=engine_file,
                               targets=[f"sm_{t}" for t in targets], tensorrt_note=note,
                               graph=graph if onnx else None, cuda_kernels=cuda_kernels, cuda_kernels_note=cuda_note)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _make_readable(tmp)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _cuda_kernels(shape, folder: Path, targets) -> tuple[str | None, str]:
    """Compile the CUDA C++ decode kernels in TensorRT's AOT convention (``export/cuda_aot.py``) into ``folder``;
    returns ``("cuda_kernels.json", the one line naming the kernels and targets compiled)``, or ``(None, the one line
    saying why not)`` (a configuration the CUDA kernel does not cover, no ``nvcc``): the Triton kernels cover every
    engine."""
    from ..export import cuda_aot

    try:
        entries = cuda_aot.build_cuda_kernels(shape, folder, targets)
    except (ValueError, RuntimeError) as exc:
        return None, f"CUDA C++ decode kernels not compiled ahead of time: {str(exc).strip().splitlines()[0]}"
    names = ", ".join(e["name"] for e in entries)
    return "cuda_kernels.json", (f"CUDA C++ decode kernels compiled ahead of time for "
                                 f"{', '.join(f'sm_{t}' for t in targets)}: {names} (kernels/cuda_kernels.json)")


def _make_readable(folder: Path) -> None:
    """Directories 0755 and files 0644 under ``folder`` and ``folder`` itself, whatever their modes were
    (``tempfile.mkdtemp`` makes the directory 0700, and files written into it may be 0600): the engine directory is
    meant to be read by a server running as another user. Symbolic links are left alone."""
    os.chmod(folder, 0o755)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o644)


def _write_model(model, source: Path, folder: Path) -> None:
    """The model as a Hugging Face folder: the source config.json, weights as safetensors, tokenizer files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    src = source if source.is_dir() else source.parent
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else None
    if config is None:  # a .gguf: the loader converted it into a cached folder with a config.json
        raise ValueError(f"{source}: no config.json next to the weights; build from the checkpoint folder")
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / "model.safetensors"))
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)


def _save_onnx(proto, path: Path) -> None:
    import onnx

    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=1024)


def _save_shared_onnx(protos: dict, folder: Path, files: dict, data_name: str, size_threshold: int = 1024) -> None:
    """Save ``protos[k]`` as ``folder / files[k]`` with every initializer of ``size_threshold`` bytes or more in one
    external file ``data_name``, written once per distinct (name, bytes): the graphs' shared weights are stored once
    and every graph's initializers point at the same offsets (ONNX external data: location, offset, length)."""
    import hashlib

    import onnx
    from onnx.external_data_helper import set_external_data
    from onnx.numpy_helper import to_array

    offsets: dict = {}
    with open(folder / data_name, "wb") as data:
        for key, proto in protos.items():
            for tensor in proto.graph.initializer:
                raw = tensor.raw_data if tensor.HasField("raw_data") else to_array(tensor).tobytes()
                if len(raw) < size_threshold:
                    continue
                ident = (tensor.name, hashlib.sha256(raw).hexdigest())
                if ident not in offsets:
                    data.seek(0, 2)
                    pad = -data.tell() % 64  # aligned like onnx's own writer (page-aligned not needed here)
                    data.write(b"\0" * pad)
                    offsets[ident] = (data.tell(), len(raw))
                    data.write(raw)
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                tensor.raw_data = raw  # set_external_data wants the raw form
                set_external_data(tensor, data_name, *offsets[ident])
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
            onnx.save(proto, str(folder / files[key]))


def plugin_register(name: str, find=None):
    """The ``register`` function of the installed plugin package for ``--plugin name``: the entry point ``name`` of
    :data:`PLUGIN_ENTRY_POINTS`, loaded (``find``: ``importlib.metadata.entry_points`` by default; tests pass their
    own).

    Raises:
        RuntimeError: no installed package declares that entry point (the message says how to install one).
    """
    found = [ep for ep in (find or entry_points)(group=PLUGIN_ENTRY_POINTS) if ep.name == name]
    if not found:
        raise RuntimeError(f"no plugin package for --plugin {name} is installed (no entry point {name!r} in the group "
                           f"{PLUGIN_ENTRY_POINTS!r}): install trtllm-diffkv from its checkout, which installs "
                           "trtllm_diffkv_plugins from plugins/ (pip install -e .)")
    return found[0].load()


def _tensorrt_engine(folder: Path, onnx_file, graph: str = "composite") -> tuple[str | None, str]:
    """Serialize rank0.engine of the composite graph where TensorRT imports; else (None, the one line that says why
    not). The per-operation and AOT graphs (``onnx_file`` a dict) get no serialized engine from this command, whether
    or not TensorRT imports; their line says so and whether it does.

    Not run on this project's machines (TensorRT cannot be installed here): written against TensorRT
    10.x's documented Python API (Builder, OnnxParser with the plugins registered by the installed plugin package,
    found by :func:`plugin_register`: ``trtllm_diffkv_plugins``, the folder ``plugins/``).
    Never run (no TensorRT here). The graph's nodes are the composite plugins ``diffkv::DiffKVAttention``
    / ``diffkv::DiffKVPageUpdate``, registered by ``plugins/trt_plugins.py``; their implementations need
    the process's ``PagedDiffKVCache`` (docs/PLUGINS.md), so such an engine runs only inside Python.
    """
    try:
        import tensorrt as trt
    except Exception as exc:  # noqa: BLE001 - ImportError, or the bindings without libnvinfer
        trt, missing = None, f"TensorRT is not importable here ({type(exc).__name__})"
    if isinstance(onnx_file, dict):  # per-operation / AOT graphs: one engine per step kind is not built here
        found = missing if trt is None else f"TensorRT {trt.__version__} is importable here"
        return None, (f"--graph {graph}: serialized engines for per-operation / AOT graphs are not built by this "
                      f"command ({found}); wrote the engine directory without a serialized engine")
    if trt is None:
        return None, f"{missing}; wrote the engine directory without a serialized engine (rank0.engine)"
    if onnx_file is None:
        return None, "no ONNX graph (--no-onnx): no serialized engine"
    plugin_register("diffkv")()  # registers diffkv::* with tensorrt.plugin
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(folder / onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse the ONNX graph: {errors}")
    engine = builder.build_serialized_network(network, builder.create_builder_config())
    if engine is None:
        raise RuntimeError("TensorRT failed to build the engine")
    (folder / "rank0.engine").write_bytes(bytes(engine))
    return "rank0.engine", f"TensorRT {trt.__version__}: serialized rank0.engine"
