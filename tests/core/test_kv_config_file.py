"""kv-config JSON files (``config.load_kv_config_file`` / ``resolve_kv_config``): round trip, refusal of
bad or mismatched files with a one-line error naming the field, and acceptance wherever a preset is."""
import json

import pytest

from conftest import tiny_llama
from trtllm_diffkv.config import (
    DiffKVConfig, TierConfig, get_preset, load_kv_config_file, resolve_kv_config, save_kv_config_file,
)
from trtllm_diffkv.generation.reference import ReferenceGenerator

CFG = DiffKVConfig(low=TierConfig(8, 2), alpha_high=2.0, alpha_low=0.01, key_rotation="hadamard",
                   rotation_seed=3, score_pool_tokens=5, name="calibrated")
TINY_SHAPE = (8, 2, 64)  # conftest.tiny_llama: num_heads, num_kv_heads, head_dim


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def _good(tmp_path):
    path = tmp_path / "kv.json"
    save_kv_config_file(path, CFG, TINY_SHAPE, calibration={"command": "test"})
    return path, json.loads(path.read_text())


def test_round_trip_and_resolution(tmp_path):
    path, data = _good(tmp_path)
    loaded = load_kv_config_file(path)
    assert loaded == CFG.replace(calibrated_for=TINY_SHAPE)
    assert resolve_kv_config(str(path)) == loaded == resolve_kv_config(path)
    assert resolve_kv_config("default") is get_preset("default") and resolve_kv_config(CFG) is CFG
    assert data["model"] == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}
    assert data["kv_config"]["low"] == {"key_bits": 8, "value_bits": 2, "key_groups": 1, "value_groups": 4}
    # A file without "model" fits any model; missing kv_config keys take the defaults.
    free = _write(tmp_path / "free.json", {"format": "trtllm-diffkv-kv-config", "version": 1,
                                            "kv_config": {"alpha_low": 0.0}})
    assert load_kv_config_file(free) == DiffKVConfig(alpha_low=0.0)


def test_a_file_for_another_model_is_refused_naming_the_field(tmp_path):
    model = tiny_llama()
    path, data = _good(tmp_path)
    ReferenceGenerator(model, None, model.config, resolve_kv_config(str(path)))  # the right model: accepted
    data["model"]["num_kv_heads"] = 4
    other = _write(tmp_path / "other.json", data)
    with pytest.raises(ValueError, match="calibrated for num_kv_heads=4; this model has num_kv_heads=2"):
        ReferenceGenerator(model, None, model.config, resolve_kv_config(str(other)))


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
    (lambda d: d["kv_config"].update(alpha_hihg=1.0), "kv_config: unknown key 'alpha_hihg'"),
    (lambda d: d["kv_config"]["low"].update(bits=4), r"kv_config.low: unknown key 'bits'"),
    (lambda d: d["model"].update(num_layers=3), "model: unknown key 'num_layers'"),
    (lambda d: d["kv_config"].update(alpha_high=5000.0), r"alpha_high=5000.0 is out of range"),
    (lambda d: d["kv_config"].update(alpha_low=3.0), r"alpha_low=3.0 is out of range"),
    (lambda d: d["kv_config"]["low"].update(key_bits=3), r"kv_config.low: key_bits=3 is not supported"),
    (lambda d: d["kv_config"].update(key_rotation="random"), "key_rotation='random' is not supported"),
    (lambda d: d["kv_config"].update(score_pool_tokens=4), "score_pool_tokens=4 must be odd"),
    (lambda d: d.update(version=2), "version=2"),
    (lambda d: d.update(format="other"), "format='other'"),
    (lambda d: d.pop("kv_config"), "missing key 'kv_config'"),
    (lambda d: d["model"].pop("head_dim"), "missing key 'head_dim'"),
])
def test_bad_files_are_refused_with_one_line_naming_the_field(tmp_path, change, message):
    _, data = _good(tmp_path)
    change(data)
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(ValueError, match=message) as info:
        load_kv_config_file(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_not_json_and_missing_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_kv_config(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_kv_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown kv-config preset 'nope'"):
        resolve_kv_config("nope")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)  # json.loads raises RecursionError on this: still one line naming the file
    with pytest.raises(ValueError, match="deep.json: not valid JSON"):
        load_kv_config_file(deep)
    with pytest.raises(ValueError, match="is a directory"):
        load_kv_config_file(tmp_path)


def test_a_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "bom.json"
    save_kv_config_file(path, get_preset("default"))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_kv_config_file(path).alpha_high == get_preset("default").alpha_high


def test_cli_llm_triton_repo_and_build_accept_a_file(tmp_path):
    from trtllm_diffkv.export.fields import EngineShape, kv_config_from_fields, kv_config_to_fields
    from trtllm_diffkv.commands.build import build_engine_dir
    from trtllm_diffkv.cli import build_parser
    from trtllm_diffkv.llmapi.llm import LLM
    from trtllm_diffkv.serve.tritonserver_repo import write_repository

    path, _ = _good(tmp_path)
    for argv in (["generate", "--kv-config", str(path)], ["serve", "--kv-config", str(path)],
                 ["triton-repo", "--kv-config", str(path), "--out", str(tmp_path / "r")],
                 ["build", "--kv-config", str(path), "--checkpoint", "c", "--output", "o", "--plugin", "diffkv"]):
        assert build_parser().parse_args(argv).kv_config == str(path)
    model = tiny_llama()
    llm = LLM.from_model(model, None, model.config, str(path), max_batch_size=2, kv_memory_bytes=1 << 22,
                         use_triton=False)
    try:
        assert llm.kv_config == load_kv_config_file(path)
        assert llm.executor.model.model.layers[0].self_attn.key_rotation is not None
    finally:
        llm.shutdown()
    model_dir = write_repository(tmp_path / "repo", kv_config=str(path))
    assert str(path.resolve()) in (model_dir / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="unknown key"):
        write_repository(tmp_path / "repo2", kv_config=str(_write(tmp_path / "b.json", {"format": 1, "x": 2})))
    # build: a bad file fails before any loading; a file for another model fails at the engine's shape.
    bad = _write(tmp_path / "c.json", {"format": "trtllm-diffkv-kv-config", "version": 1, "kv_config": {"x": 1}})
    with pytest.raises(ValueError, match="kv_config: unknown key 'x'"):
        build_engine_dir(tmp_path, tmp_path / "engine", kv_config=str(bad))
    with pytest.raises(ValueError, match="calibrated for head_dim=64; this model has head_dim=128"):
        EngineShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=128, kv_config=load_kv_config_file(path),
                    dtype="float32", max_batch_size=1, max_seq_len=16)
    # An engine directory keeps the new fields (build writes kv_config_to_fields into config.json).
    assert kv_config_from_fields(kv_config_to_fields(CFG)) == CFG


def test_per_layer_sliding_windows_validate_round_trip_and_follow_the_model(tmp_path):
    """``DiffKVConfig.layers`` (config.LayerSettings): validated naming the field, written and read back by kv-config
    files, filled from a model's sliding windows by ``for_model``; a file whose windows differ from the model's, or a
    config for another layer count, is refused naming the layer."""
    from types import SimpleNamespace

    from trtllm_diffkv.config import DiffKVConfig, LayerSettings, save_kv_config_file

    for bad in (0, -3, True, "512", 2**31):
        with pytest.raises(ValueError, match="sliding_window_tokens"):
            LayerSettings(bad)
    with pytest.raises(ValueError, match="tuple of LayerSettings"):
        DiffKVConfig(layers=(512, None))
    gemma_like = SimpleNamespace(num_layers=3, sliding_windows=(8, 8, None))
    llama_like = SimpleNamespace(num_layers=3, sliding_windows=(None, None, None))
    base = DiffKVConfig(name="t")
    assert base.for_model(llama_like) is base and base.sliding_windows(3) == (None, None, None)
    cfg = base.for_model(gemma_like)
    assert cfg.layers == (LayerSettings(8), LayerSettings(8), LayerSettings(None))
    assert cfg.sliding_windows(3) == (8, 8, None) and cfg.for_model(gemma_like) is cfg
    assert DiffKVConfig(layers=[LayerSettings(4)]).layers == (LayerSettings(4),)  # a list is stored as a tuple
    with pytest.raises(ValueError, match=r"layers\[1\].sliding_window_tokens=8; the model's layer 1 has sliding window 16"):
        cfg.for_model(SimpleNamespace(num_layers=3, sliding_windows=(8, 16, None)))
    with pytest.raises(ValueError, match="settings for 3 layers; the model has 4"):
        cfg.validate_for_model(64, 4, 1, num_layers=4)
    save_kv_config_file(tmp_path / "w.json", cfg)
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["kv_config"]["layers"] == [{"sliding_window_tokens": 8}, {"sliding_window_tokens": 8},
                                           {"sliding_window_tokens": None}]
    assert load_kv_config_file(tmp_path / "w.json") == cfg
    data["kv_config"]["layers"][2] = {"sliding_window_tokens": None, "alpha": 1}
    with pytest.raises(ValueError, match=r"kv_config.layers\[2\]: unknown key 'alpha'"):
        load_kv_config_file(_write(tmp_path / "x.json", data))
    data["kv_config"]["layers"] = {"sliding_window_tokens": 8}
    with pytest.raises(ValueError, match="kv_config.layers must be a JSON list"):
        load_kv_config_file(_write(tmp_path / "y.json", data))
