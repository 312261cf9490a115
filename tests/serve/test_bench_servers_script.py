"""tools/bench_servers_gpu.py's pure parts (the device run itself: tools/gpu_servers.sh, dry-run on the CPU with
``GPU_SERVERS_ARGS=--smoke``): which serve flags each OpenAI leg passes and when it is skipped, the Markdown
fragment the lead pastes into docs/SERVING.md, and the merge of legs run one by one."""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_servers_gpu.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_servers_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OLD_HELP = "usage: trtllm-diffkv serve [--max-batch-size N] [--threads N]"
NEW_HELP = ("usage: trtllm-diffkv serve [--max-num-tokens MAX_NUM_TOKENS]\n"
            "  --enable-chunked-prefill, --no-enable-chunked-prefill")


def test_legs_pass_the_chunked_prefill_flags_or_are_skipped(script):
    args = SimpleNamespace(max_num_tokens=512, serve_args="--max-seq-len 4096")
    assert script.leg_serve_flags("openai", args, OLD_HELP) == (["--max-seq-len", "4096"], None, None)
    for leg in ("openai-chunked", "openai-unchunked"):
        flags, _, skipped = script.leg_serve_flags(leg, args, OLD_HELP)
        assert flags == [] and "serve has no" in skipped
    assert script.leg_serve_flags("openai-chunked", args, NEW_HELP) == (
        ["--max-num-tokens", "512", "--enable-chunked-prefill", "--max-seq-len", "4096"], True, None)
    assert script.leg_serve_flags("openai-unchunked", args, NEW_HELP) == (
        ["--no-enable-chunked-prefill", "--max-seq-len", "4096"], False, None)


def _row(server, **extra):
    row = {"server": server, "serve_flags": [], "chunked_prefill": None, "concurrency": 64, "max_tokens": 128,
           "kv_config": "default", "requests": 256, "completed": 256, "errors": [], "requests_per_s": 36.55,
           "output_tokens_per_s": 4680.0, "ttft_p50_ms": 399.0, "ttft_p99_ms": 899.0, "tpot_p50_ms": 9.5,
           "tpot_p99_ms": 12.25, "itl_p99_ms": 20.0, "e2e_p50_ms": 1700.0, "e2e_p99_ms": 2500.0}
    row.update(extra)
    return row


def test_markdown_and_merge(script, tmp_path):
    parts = []
    for name, rows in (("triton", [_row("triton", errors=["HTTP 500"])]),
                       ("openai", [_row("openai")]),
                       ("openai-unchunked", [{"server": "openai-unchunked", "skipped": "serve has no flag"}])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-12-02", "commit": "abc1234",
                                    "command": f"python3 tools/bench_servers_gpu.py --servers {name}",
                                    "results": rows}))
        parts.append(str(path))
    parts.append(str(tmp_path / "openai-chunked.json"))            # a leg that left nothing (timed out)
    out, md = tmp_path / "all.json", tmp_path / "all.md"
    assert script.merge(parts, out, md) == 1                       # the missing leg is an error
    record = json.loads(out.read_text())
    assert [r["server"] for r in record["results"]] == ["triton", "openai", "openai-unchunked", "openai-chunked"]
    assert "timed out or crashed" in record["results"][3]["error"] and record["gpu"] == "NVIDIA H200"
    lines = md.read_text().splitlines()
    assert lines[2] == ("| triton | executor default | 36.55 | 4680.0 | 399.0 / 899.0 | 9.50 / 12.25 | 20.0 | "
                        "1700.0 / 2500.0 | 1 of 256 |")
    assert lines[3].startswith("| openai | serve's default | 36.55 |")
    assert lines[4].startswith("| openai-unchunked | off | - |") and "skipped: serve has no flag" in lines[4]
    assert lines[5].startswith("| openai-chunked | on | - |") and "failed: no result" in lines[5]
    assert "NVIDIA H200, 2026-12-02, commit `abc1234`; 64 concurrent streaming clients, 256 requests" in md.read_text()
    assert "`python3 tools/bench_servers_gpu.py --servers openai`" in md.read_text()
