"""benchmarks/bench_step.py --smoke on the CPU: the step.json schema of issue 19, floors that follow from
their byte counts, pool bytes against the FP16 bytes of the tokens held, and the profile table."""
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_step  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "step.json"
    assert bench_step.main(["--smoke", "--output", str(out)]) == 0
    return json.loads(out.read_text()), json.loads(out.with_name("step_profile.json").read_text())


def test_schema_and_points(smoke):
    step, _ = smoke
    assert list(step) == ["gpu", "date", "commit", "command", "copy_bandwidth_gbps", "rows"]
    assert step["command"] == "python benchmarks/bench_step.py --smoke --output " + step["command"].split()[-1]
    (shape,) = bench_step.default_shapes(smoke=True)
    assert bench_step.step_presets(shape) == ("fp16", "k8v4", shape.preset)  # k8v4 at equal batch (issue 41)
    want = [(shape.name, b, c, p) for b, c in shape.points for p in ("fp16", "k8v4", shape.preset)]
    assert [(r["shape"], r["batch"], r["context_tokens"], r["preset"]) for r in step["rows"]] == want
    for row in step["rows"]:
        assert tuple(row) == bench_step.ROW_FIELDS
        assert row["step_ms"] > 0 and row["model_no_attention_ms"] > 0 and isinstance(row["kv_bytes_read"], int)
        assert row["overlap"] is True  # the default: the executor's overlap scheduler


def test_floors_follow_from_bytes(smoke):
    step, _ = smoke
    bw = step["copy_bandwidth_gbps"] * 1e9
    cfg = bench_step.TINY_SHAPE
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"]
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    # fp32 on the CPU; every matrix and norm of the layers, the final norm, the (untied) LM head
    weight_bytes = 4 * (L * (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h) + h + cfg["vocab_size"] * h)
    for row in step["rows"]:
        assert row["weight_floor_ms"] == pytest.approx(weight_bytes / bw * 1e3, rel=1e-9)
        assert row["kv_floor_ms"] == pytest.approx(row["kv_bytes_read"] / bw * 1e3, rel=1e-9)
    for fp16, k8v4, diffkv in zip(step["rows"][::3], step["rows"][1::3], step["rows"][2::3]):
        # FP16 pages hold every token of every row at 2 bytes (K and V), plus page rounding and row metadata
        tokens = fp16["batch"] * fp16["context_tokens"]
        exact = tokens * L * cfg["num_kv_heads"] * cfg["head_dim"] * 2 * 2
        assert exact <= fp16["kv_bytes_read"] <= 3 * exact
        assert 0 < diffkv["kv_bytes_read"] < fp16["kv_bytes_read"]   # the DiffKV preset stores fewer bytes
        assert 0 < k8v4["kv_bytes_read"] < fp16["kv_bytes_read"]     # so does uniform K8V4
        assert (k8v4["preset"], k8v4["batch"], k8v4["context_tokens"]) == ("k8v4", fp16["batch"], fp16["context_tokens"])


def test_profile_table(smoke):
    _, prof = smoke
    (shape,) = bench_step.default_shapes(smoke=True)
    largest = max(shape.points, key=lambda p: p[0] * p[1])
    assert [(r["batch"], r["context_tokens"], r["preset"]) for r in prof["rows"]] == \
        [(*largest, "fp16"), (*largest, "k8v4"), (*largest, shape.preset)]
    for row in prof["rows"]:
        names = [k["name"] for k in row["kernels"]]
        assert "aten::mm" in names or "aten::linear" in names
        us = [k["us_per_step"] for k in row["kernels"]]
        assert us == sorted(us, reverse=True) and us[0] > 0
        own = [h["own_us_per_step"] for h in row["host"]]  # the host profile: the executor's Python functions
        assert len(own) == 30 and own == sorted(own, reverse=True) and own[0] > 0
        assert all(h["cumulative_us_per_step"] >= h["own_us_per_step"] for h in row["host"])
        assert any("trtllm_diffkv" in h["function"] for h in row["host"])


def test_weight_bytes_count_a_tied_head_once():
    from trtllm_diffkv.model import ModelConfig
    from trtllm_diffkv.evaluation.throughput import random_llama

    cfg = dict(bench_step.TINY_SHAPE, tie_word_embeddings=True)
    model = random_llama(ModelConfig(**cfg), device=torch.device("cpu"), dtype=torch.float32)
    untied = random_llama(ModelConfig(**bench_step.TINY_SHAPE), device=torch.device("cpu"), dtype=torch.float32)
    assert bench_step.weight_bytes_per_step(model) == bench_step.weight_bytes_per_step(untied)
    embed_bytes = cfg["vocab_size"] * cfg["hidden_size"] * 4
    total = sum(p.numel() * 4 for p in untied.parameters())
    assert bench_step.weight_bytes_per_step(untied) == total - embed_bytes
