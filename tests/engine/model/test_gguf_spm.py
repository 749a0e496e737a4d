"""A GGUF's SentencePiece tokenizer (common/gguf_spm.py) against sentencepiece itself: a small
BPE model trained here (as Llama's and Gemma's are: byte fallback, no normalization, a space
before the text or not), its pieces, scores and types written into a GGUF by the `gguf`
package's writer, read back by the gateway's loader: the same ids for every test text,
and the same text back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.common.tokenizer_files import load_tokenizer_files

spm = pytest.importorskip("sentencepiece")

SENTENCE = (
    "the quick brown fox jumps over the lazy dog while seven wizards quietly hex "
    "a jovial judge and bright vixens vex the wizard's jumpy mood; 1234 apples, 56 pears."
)
WORDS = SENTENCE.split(" ")
CORPUS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "unseen wordsmithing, jumpiest foxes!",
    "héllo wörld ☃ 日本語 🙂",
    "  two leading spaces and two  inside  ",
    "line one\nline two\ttab",
    "numbers 1234567 and 3.14",
]
# GGUF token types (llama.cpp)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def train(directory: Path, dummy_prefix: bool) -> Any:
    prefix = directory / f"spm_{dummy_prefix}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(prefix), vocab_size=360,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def write_gguf(sp: Any, path: Path, dummy_prefix: bool) -> Path:
    import gguf
    import numpy as np

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        return CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i) else NORMAL

    n = sp.get_piece_size()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(dummy_prefix)
    w.add_tensor("token_embd.weight", np.zeros((n, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("dummy_prefix", [True, False], ids=["llama", "gemma"])
def test_gguf_sentencepiece_tokenizes_as_sentencepiece(tmp_path: Path, dummy_prefix: bool) -> None:
    sp = train(tmp_path, dummy_prefix)
    files = load_tokenizer_files(write_gguf(sp, tmp_path / "spm.gguf", dummy_prefix))
    assert (files.bos_token, files.eos_token, files.add_bos_token) == ("<s>", "</s>", True)
    ours = files.tokenizer
    for text in TEXTS:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want) == sp.decode(want), text
    # Byte fallback was exercised (characters the training text lacks) and merges were too.
    ids = sp.encode(TEXTS[2])
    assert any(sp.is_byte(i) for i in ids)
    assert len(sp.encode(TEXTS[0])) < len(TEXTS[0]) // 2
