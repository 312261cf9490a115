"""``trtllm-diffkv build``: the engine directory's layout, config and permissions (readable by other users),
ModelRunner.from_dir on it gives the same greedy tokens as ``trtllm-diffkv generate``, and bad arguments fail in one
line leaving nothing behind."""
import argparse
import json
import os
import stat

import pytest

import tiny_checkpoint
from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.export import engine_dir
from trtllm_diffkv.commands import build as build_cmd


def _parser():
    parser = argparse.ArgumentParser(prog="trtllm-diffkv")
    build_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv):
    args = _parser().parse_args(["build", *argv])
    return args.run(args)


def _assert_readable_by_others(out):
    """Every file of the engine dir readable by other users (o+r) and every directory, itself included, listable and
    enterable by them (o+rx): tempfile.mkdtemp makes 0700 and some writers 0600."""
    paths = [out, *out.rglob("*")]
    assert len(paths) > 5
    for path in paths:
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            assert mode & 0o005 == 0o005, (path, oct(mode))
        elif stat.S_ISREG(mode):
            assert mode & 0o004, (path, oct(mode))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny checkpoint and its engine dir (float32, default preset, sm_90 kernels only: tests/export/test_aot.py
    compiles both targets)."""
    root = tmp_path_factory.mktemp("build")
    ckpt = write_tiny_text_checkpoint(root / "ckpt")
    out = root / "engine"
    assert _run(["--checkpoint", str(ckpt), "--output", str(out), "--plugin", "diffkv", "--kv-config", "default",
                 "--max-batch-size", "4", "--max-seq-len", "96", "--dtype", "float32", "--targets", "90"]) == 0
    return ckpt, out


def test_engine_dir_layout_and_config(built, capsys):
    ckpt, out = built
    config = json.loads((out / "config.json").read_text())
    assert set(config) == {"version", "pretrained_config", "build_config", "diffkv"}
    pc, bc, dk = config["pretrained_config"], config["build_config"], config["diffkv"]
    assert (pc["architecture"], pc["dtype"], pc["num_hidden_layers"], pc["num_attention_heads"],
            pc["num_key_value_heads"], pc["head_size"], pc["vocab_size"]) == \
        ("LlamaForCausalLM", "float32", 2, 2, 1, 64, 49152)
    assert (bc["max_batch_size"], bc["max_seq_len"], bc["plugin_config"]["diffkv_plugin"]) == (4, 96, "float32")
    assert dk["onnx"] == "model.onnx" and dk["engine"] is None
    assert dk["tensorrt"].startswith("TensorRT is not importable here (") and \
        dk["tensorrt"].endswith("wrote the engine directory without a serialized engine (rank0.engine)")
    assert dk["cuda_kernels"] is None and dk["cuda_kernels_note"].startswith(
        "CUDA C++ decode kernels not compiled ahead of time: ")  # float32: not a CUDA kernel configuration
    _assert_readable_by_others(out)
    assert os.lstat(out / "model.onnx.data").st_mode & 0o777 == 0o644 and os.lstat(out).st_mode & 0o777 == 0o755
    manifest = json.loads((out / "kernels" / "manifest.json").read_text())
    assert manifest["targets"] == ["sm_90"] and manifest["engine"]["max_seq_len"] == 96
    for k in manifest["kernels"]:
        assert (out / "kernels" / k["compiled"]["sm_90"]["cubin"]).stat().st_size > 0
    import onnx

    proto = onnx.load(str(out / "model.onnx"))  # external weights in model.onnx.data
    assert sum(n.op_type == "DiffKVAttention" for n in proto.graph.node) == 2
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert engine_dir.is_engine_dir(out) and not engine_dir.is_engine_dir(ckpt)
    info = engine_dir.read_engine_dir(out)
    assert (info.max_batch_size, info.max_seq_len, info.dtype, info.kv_config.name) == (4, 96, "float32", "default")
    assert info.model_path == out / "model"
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def test_model_runner_on_engine_dir_matches_generate(built, capsys):
    """ModelRunner.from_dir(ENGINE_DIR) (executor, paged cache) == `trtllm-diffkv generate` (reference path)."""
    from trtllm_diffkv import ModelRunner
    from trtllm_diffkv.cli import main

    ckpt, out = built
    prompt = "The quick brown fox"
    assert main(["generate", "--model", str(ckpt), "--prompt", prompt, "--max-new-tokens", "6", "--json",
                 "--no-chat-template", "--device", "cpu", "--kv-config", "default", "--engine", "reference",
                 "--threads", "1"]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    runner = ModelRunner.from_dir(out, device="cpu", kv_memory_bytes=16 << 20)
    try:
        assert runner.llm.kv_config.name == "default"  # from the engine dir (max_batch_size: see the report)
        ids = runner.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        res = runner.generate([ids], max_new_tokens=6, end_id=runner.tokenizer.eos_token_id,
                              output_sequence_lengths=True, return_dict=True)
        n = int(res["sequence_lengths"][0, 0])
        got = res["output_ids"][0, 0, len(ids):n].tolist()
    finally:
        runner.shutdown()
    assert len(expected) >= 1 and got[:len(expected)] == expected


def test_per_op_graphs_build(built, tmp_path):
    """``--graph per-op``: model_prefill.onnx + model_decode.onnx (checker and shape inference pass on the saved files;
    the decode graph holds its plan nodes), recorded in config.json, the weights stored once in one shared
    model.onnx.data that both graphs point into; ModelRunner.from_dir runs the directory (PyTorch executor) with the
    same greedy tokens as the composite build's directory."""
    import numpy as np
    import onnx
    from onnx.numpy_helper import to_array

    ckpt, composite = built
    out = tmp_path / "engine"
    assert _run(["--checkpoint", str(ckpt), "--output", str(out), "--plugin", "diffkv", "--max-batch-size", "4",
                 "--max-seq-len", "96", "--dtype", "float32", "--targets", "90", "--graph", "per-op"]) == 0
    dk = json.loads((out / "config.json").read_text())["diffkv"]
    assert (dk["graph"], dk["onnx"], dk["onnx_data"]) == \
        ("per-op", {"prefill": "model_prefill.onnx", "decode": "model_decode.onnx"}, "model.onnx.data")
    assert json.loads((composite / "config.json").read_text())["diffkv"]["graph"] == "composite"
    assert not (out / "model.onnx").exists() and sorted(p.name for p in out.glob("*.onnx*")) == \
        ["model.onnx.data", "model_decode.onnx", "model_prefill.onnx"]
    protos = {}
    for phase, name in dk["onnx"].items():
        onnx.checker.check_model(str(out / name))  # by path: the external data is checked too
        onnx.shape_inference.infer_shapes_path(str(out / name), str(tmp_path / f"{phase}.inferred.onnx"), strict_mode=True)
        protos[phase] = onnx.load(str(out / name))
    ops = [n.op_type for n in protos["decode"].graph.node if n.domain == "diffkv"]
    assert ops == ["decode_decide", "page_update", "decode_locate"] + ["decode_attention"] * 2
    assert [n.op_type for n in protos["prefill"].graph.node if n.domain == "diffkv"] == ["prefill_attention"] * 2
    weights = {phase: {t.name: to_array(t) for t in p.graph.initializer} for phase, p in protos.items()}
    shared = [n for n, a in weights["prefill"].items() if a.nbytes >= 1024 and n in weights["decode"]]
    assert shared and all(np.array_equal(weights["prefill"][n], weights["decode"][n]) for n in shared)
    largest = sum(a.nbytes for a in weights["decode"].values() if a.nbytes >= 1024)
    assert largest <= (out / "model.onnx.data").stat().st_size < largest * 1.01  # stored once, not twice
    assert dk["engine"] is None and dk["tensorrt"].startswith(
        "--graph per-op: serialized engines for per-operation / AOT graphs are not built by this command (")
    assert "TensorRT is not importable here" in dk["tensorrt"] or "is importable here" in dk["tensorrt"]
    assert "\n" not in dk["tensorrt"]
    _assert_readable_by_others(out)
    got = _greedy_tokens(out, composite)
    assert got[0] == got[1]


def test_aot_graph_build(built, tmp_path, capsys):
    """``--graph aot``: the AOT prefill and decode graphs (their DiffKV work as standard ONNX operators and one
    ``diffkv::aot_<wrapper>`` node per kernel launch - the prefill graph per layer three prompt-score launches and two
    token writes, no ``prefill_attention`` node - each wrapper compiled in the manifest's ``trt_abi`` with its PTX entry
    in TensorRT's convention and the node's shared memory the compiled one), recorded in config.json; the CUDA C++
    kernels are not compiled for a float32 engine and the build says why in one line, also in config.json; the TensorRT
    line says that this command builds no serialized engine for these graphs; ModelRunner.from_dir gives the composite
    build's greedy tokens; ``--dtype auto`` on this float32 checkpoint is a float32 build and works, a float16 build
    fails in one line and leaves nothing."""
    import onnx

    from trtllm_diffkv.export import trt_abi

    ckpt, composite = built
    out = tmp_path / "engine"
    args = ["--checkpoint", str(ckpt), "--plugin", "diffkv", "--max-batch-size", "4", "--max-seq-len", "96",
            "--targets", "90", "--graph", "aot"]
    assert _run([*args, "--output", str(tmp_path / "bad"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "--graph aot: the AOT graphs' activations are float32" in err
    assert "needs a float32 build (--dtype float32, or auto on a float32 checkpoint); this build: float16" in err
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    assert _run([*args, "--output", str(out), "--dtype", "auto"]) == 0  # the checkpoint's weights are float32
    err = capsys.readouterr().err
    assert "CUDA C++ decode kernels not compiled ahead of time:" in err
    config = json.loads((out / "config.json").read_text())
    dk = config["diffkv"]
    assert config["pretrained_config"]["dtype"] == "float32"
    assert (dk["graph"], dk["onnx"], dk["cuda_kernels"]) == \
        ("aot", {"prefill": "model_prefill.onnx", "decode": "model_decode.onnx"}, None)
    note = dk["cuda_kernels_note"]
    assert note.startswith("CUDA C++ decode kernels not compiled ahead of time: ") and len(note) > 52
    assert "\n" not in note and note in err  # the line the build printed
    assert dk["engine"] is None and dk["tensorrt"].startswith(
        "--graph aot: serialized engines for per-operation / AOT graphs are not built by this command (")
    assert "TensorRT is not importable here" in dk["tensorrt"] or "is importable here" in dk["tensorrt"]
    _assert_readable_by_others(out)
    manifest = json.loads((out / "kernels" / "manifest.json").read_text())
    wrappers = {k["name"]: trt_abi.AbiKernel.from_json(k) for k in manifest["trt_abi"]}
    protos = {}
    for phase in ("prefill", "decode"):
        onnx.checker.check_model(str(out / f"model_{phase}.onnx"))  # by path: the external data is checked too
        protos[phase] = onnx.load(str(out / f"model_{phase}.onnx"))
    nodes = {ph: [n for n in p.graph.node if n.domain == "diffkv"] for ph, p in protos.items()}
    assert nodes["decode"] and all(n.op_type.startswith("aot_") for n in nodes["decode"])
    prefill_ops = [n.op_type for n in protos["prefill"].graph.node]
    assert "prefill_attention" not in prefill_ops
    assert all(n.op_type.startswith("aot_") for n in nodes["prefill"])
    layers = config["pretrained_config"]["num_hidden_layers"]
    kernels = [wrappers[n.op_type.removeprefix("aot_")].kernel.rsplit(":", 1)[-1] for n in nodes["prefill"]]
    score = ("_prompt_lse_kernel", "_prompt_lse_merge_kernel", "_prompt_score_kernel")
    assert sorted(kernels) == sorted([*score, "_write_tokens_kernel", "_write_tokens_kernel"] * layers), kernels
    for node in nodes["prefill"] + nodes["decode"]:
        c = wrappers[node.op_type.removeprefix("aot_")].compiled["sm_90"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["shared_mem"] == c["shared_bytes"] and len(node.input) == len(node.output)
        ptx = (out / "kernels" / c["ptx"]).read_text()
        n = len(node.input)
        assert trt_abi.ptx_entry_params(ptx, c["kernel_name"]) == \
            [".u64"] * n + [".u32"] * len(json.loads(attrs["extras"])) + [".u64"] * n
    got = _greedy_tokens(out, composite)
    assert got[0] == got[1]


def test_graph_help_lists_the_choices():
    """``--graph``'s help and usage list every graph form ``onnx_export`` writes (the values are checked by the
    command, so a bad one is its one-line error: test_bad_arguments_fail_in_one_line_and_leave_nothing)."""
    from trtllm_diffkv import export as build_pkg
    from trtllm_diffkv.export import onnx_export
    from trtllm_diffkv.export.onnx_export import EXPORT_GRAPHS

    assert onnx_export.EXPORT_GRAPHS is build_pkg.EXPORT_GRAPHS  # one definition, read by the command and the exporter
    build = _parser()._subparsers._group_actions[0].choices["build"]
    (action,) = [a for a in build._actions if "--graph" in a.option_strings]
    assert action.metavar == "{composite,per-op,aot}"
    assert "one of " + ", ".join(EXPORT_GRAPHS) + ":" in action.help
    text = " ".join(build.format_help().split())
    assert "--graph {composite,per-op,aot}" in text and "a float32 build: --dtype float32, or auto on a float32" \
        " checkpoint" in text


def _greedy_tokens(*dirs):
    """ModelRunner.from_dir of each engine dir (CPU): 4 greedy tokens after the same prompt."""
    from trtllm_diffkv import ModelRunner

    runners = [ModelRunner.from_dir(d, device="cpu", kv_memory_bytes=16 << 20) for d in dirs]
    try:
        got = []
        for runner in runners:
            ids = runner.tokenizer("The quick brown fox", return_tensors="pt")["input_ids"][0]
            res = runner.generate([ids], max_new_tokens=4, end_id=runner.tokenizer.eos_token_id, return_dict=True)
            got.append(res["output_ids"][0, 0].tolist())
    finally:
        for runner in runners:
            runner.shutdown()
    return got


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".out"))


@pytest.mark.parametrize("case", ["plugin", "missing", "target", "head_dim", "exists", "compile", "seq_len", "graph",
                                  "per_op_no_onnx"])
def test_bad_arguments_fail_in_one_line_and_leave_nothing(case, tmp_path, capsys, monkeypatch):
    if case == "head_dim":  # 4 heads of 32: no DiffKV kernels for head_dim 32
        monkeypatch.setitem(tiny_checkpoint.TINY_TEXT_CONFIG, "head_dim", 32)
        monkeypatch.setitem(tiny_checkpoint.TINY_TEXT_CONFIG, "num_attention_heads", 4)
    ckpt = tmp_path / "none" if case == "missing" else write_tiny_text_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    if case == "exists":
        out.mkdir()
    if case == "compile":
        from trtllm_diffkv.export import aot

        def fail(*a, **kw):
            raise RuntimeError("write_tokens_kernel__x failed to compile for sm_90: boom")
        monkeypatch.setattr(aot, "build_kernels", fail)
    argv = ["--checkpoint", str(ckpt), "--output", str(out), "--plugin", "gpt_attention" if case == "plugin" else
            "diffkv", "--targets", "75" if case == "target" else "90", "--dtype", "float32", "--max-seq-len",
            "100000" if case == "seq_len" else "64",
            "--no-onnx", *{"graph": ["--graph", "bogus"], "per_op_no_onnx": ["--graph", "per-op"]}.get(case, [])]
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1, err
    expect = {"plugin": "'gpt_attention' is not supported", "missing": "does not exist", "target": "sm_75",
              "head_dim": "head_dim=32", "exists": "already exists", "compile": "failed to compile",
              "seq_len": "exceeds the model's", "graph": "--graph 'bogus': expected one of composite, per-op",
              "per_op_no_onnx": "cannot be combined with --no-onnx"}[case]
    assert expect in errors[0]
    assert out.exists() == (case == "exists") and not (out / "config.json").exists()
    assert _leftovers(tmp_path) == []
