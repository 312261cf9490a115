"""``check_gguf_tokenizer`` on tokenizers transformers really rebuilds from GGUF files of other families.

Each file carries the tokenizer metadata llama.cpp's ``convert_hf_to_gguf.py`` writes for its family (no
weights: ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` reads only the header), over a vocabulary
trained here with ``tokenizers`` on text holding the probe words:

* Llama 2 / Mistral: SentencePiece BPE (``tokenizer.ggml.model = "llama"``), scores, token types, ``<0xNN>``
  byte-fallback tokens, ``add_space_prefix``, BOS ``<s>``;
* Llama 3 / Qwen2 / SmolLM: byte-level BPE (``"gpt2"``) with merges and ``tokenizer.ggml.pre``.

A legitimate file must pass (a false refusal stops users from loading the model at all); a tokenizer that
reads it otherwise must still be refused.
"""
from __future__ import annotations

import json

import pytest
from packaging.version import Version

from trtllm_diffkv.model.gguf_convert import TOKENIZER_PROBES, _byte_symbols, check_gguf_tokenizer

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.25"),
    reason="transformers before 5.25 rebuilds SentencePiece and Llama 3 tokenizers without BOS (rightly refused)")

SPACE = "\u2581"
TEXT = [*TOKENIZER_PROBES] * 20 + [
    "The quick brown fox jumps over the lazy dog. A capital city is where the government sits.",
    "import os\nclass Counter:\n    def __init__(self):\n        self.values = []\n",
]
"""Training text: the probes, often enough that their words become tokens (``▁result.`` too, as a vocabulary
trained without a punctuation split has), and a little more."""


def _header(w, n_vocab: int) -> None:
    """The architecture keys transformers' config import reads (a 1-layer toy; no tensors)."""
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


@pytest.fixture(scope="module")
def spm_tokens() -> list[str]:
    """A Llama 2 style vocabulary: ``<unk> <s> </s>``, ``<0x00>``..``<0xFF>``, then BPE pieces over U+2581 words.

    Pieces holding a newline are dropped, so a newline is spelled only by ``<0x0A>`` (as in Llama 2).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False))
    vocab = tok.get_vocab()
    return [t for t in sorted(vocab, key=vocab.get) if "\n" not in t]


def _write_spm(path, tokens, **flags) -> None:
    """A ``llama``-tokenizer GGUF as convert_hf_to_gguf writes it; ``flags``: ``add_bos``, ``bos``,
    ``add_space_prefix`` (``None``: key absent)."""
    flags = {"add_bos": True, "bos": 1, "add_space_prefix": True} | flags
    w = gguf.GGUFWriter(str(path), "llama")
    _header(w, len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])  # SentencePiece BPE: earlier piece, earlier merge
    w.add_token_types([2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1
                       for t in tokens])
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if flags["bos"] is not None:
        w.add_bos_token_id(flags["bos"])
    if flags["add_bos"] is not None:
        w.add_add_bos_token(flags["add_bos"])
    if flags["add_space_prefix"] is not None:
        w.add_add_space_prefix(flags["add_space_prefix"])
    _close(w)


def _rebuilt(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _names(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_llama2_sentencepiece_file_passes(tmp_path, spm_tokens):
    """Its merges read ``result.`` as ``▁result.``, not ``▁result`` ``.``: right for this vocabulary."""
    assert {SPACE + "capital", SPACE + "result", SPACE + "result.", "<0x0A>"} <= set(spm_tokens)
    _write_spm(tmp_path / "llama2.gguf", spm_tokens)
    tokenizer = _rebuilt(tmp_path / "llama2.gguf")
    names = _names(tokenizer, TOKENIZER_PROBES[0])
    assert SPACE + "capital" in names and names[-1] == SPACE + "result."
    assert "<0x0A>" in _names(tokenizer, TOKENIZER_PROBES[1])  # the newline only byte fallback spells
    assert tokenizer(TOKENIZER_PROBES[0])["input_ids"][0] == 1
    check_gguf_tokenizer(tokenizer, tmp_path / "llama2.gguf")


@pytest.mark.parametrize("flags", [{"add_bos": None}, {"bos": None}, {"add_bos": False}, {"add_space_prefix": None}],
                         ids=["add_bos_absent", "bos_id_absent", "no_bos", "add_space_prefix_absent"])
def test_a_sentencepiece_file_missing_a_flag_passes(tmp_path, spm_tokens, flags):
    _write_spm(tmp_path / "spm.gguf", spm_tokens, **flags)
    check_gguf_tokenizer(_rebuilt(tmp_path / "spm.gguf"), tmp_path / "spm.gguf")


def test_a_sentencepiece_file_without_the_bos_flag_still_wants_bos(tmp_path, spm_tokens):
    """llama.cpp adds BOS to a SentencePiece vocabulary that does not say (transformers 5.17 did not)."""
    _write_spm(tmp_path / "spm.gguf", spm_tokens, add_bos=None)
    tokenizer = _rebuilt(tmp_path / "spm.gguf")

    class NoBos:
        def __call__(self, text, add_special_tokens=True):
            return tokenizer(text, add_special_tokens=False)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    with pytest.raises(ValueError, match=r"adds BOS \(id 1\)"):
        check_gguf_tokenizer(NoBos(), tmp_path / "spm.gguf")


def test_a_decoder_that_keeps_sentencepieces_prefix_space_passes(tmp_path, spm_tokens):
    """SentencePiece's legacy decoders give `` The capital ...``: the ids, what the model reads, are right."""
    _write_spm(tmp_path / "spm.gguf", spm_tokens)
    tokenizer = _rebuilt(tmp_path / "spm.gguf")

    class Legacy:
        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

        def decode(self, ids):
            return " " + tokenizer.decode(ids)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    check_gguf_tokenizer(Legacy(), tmp_path / "spm.gguf")


def _bpe_vocab(drop: str = "") -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary and merges trained on :data:`TEXT` without the characters ``drop``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bad = {_byte_symbols()[ord(c)] for c in drop}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = [a for a in pre_tokenizers.ByteLevel.alphabet() if a not in bad]
    text = [t.translate({ord(c): None for c in drop}) for t in TEXT]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=700, initial_alphabet=alphabet,
                                                      show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return sorted(model["vocab"], key=model["vocab"].get), merges


def _write_bpe(path, pre: str, bos: str, add_bos: bool, arch: str = "llama", drop: str = "") -> int:
    """A ``gpt2``-tokenizer GGUF as convert_hf_to_gguf writes it; returns the BOS id."""
    tokens, merges = _bpe_vocab(drop)
    tokens = [*tokens, bos, "<|end_of_text|>"]
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(add_bos)
    _close(w)
    return len(tokens) - 2


@pytest.mark.parametrize("pre, bos, add_bos, arch", [
    ("llama-bpe", "<|begin_of_text|>", True, "llama"),  # Llama 3
    ("qwen2", "<|endoftext|>", False, "qwen2"),
    ("smollm", "<|im_start|>", False, "llama"),
])
def test_a_byte_level_bpe_file_passes(tmp_path, pre, bos, add_bos, arch):
    bos_id = _write_bpe(tmp_path / "bpe.gguf", pre, bos, add_bos, arch)
    tokenizer = _rebuilt(tmp_path / "bpe.gguf")
    assert "\u0120capital" in _names(tokenizer, TOKENIZER_PROBES[0])
    assert (tokenizer(TOKENIZER_PROBES[0])["input_ids"][0] == bos_id) == add_bos
    check_gguf_tokenizer(tokenizer, tmp_path / "bpe.gguf")


def test_a_vocabulary_that_cannot_spell_a_probe_skips_only_its_round_trip(tmp_path):
    """No ``:`` or ``(``: the code probe cannot come back, the prose one still must."""
    _write_bpe(tmp_path / "bpe.gguf", "llama-bpe", "<|begin_of_text|>", True, drop=":(")
    tokenizer = _rebuilt(tmp_path / "bpe.gguf")
    assert tokenizer.decode(tokenizer(TOKENIZER_PROBES[1], add_special_tokens=False)["input_ids"]) != TOKENIZER_PROBES[1]
    check_gguf_tokenizer(tokenizer, tmp_path / "bpe.gguf")
