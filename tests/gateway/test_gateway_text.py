"""Gateway text handling: incremental detokenization, stop strings, and the tokenizer (our
GGUF-built one against HF transformers, and the byte-level test tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from llmserve.gateway.stop import StopStringMatcher
from llmserve.gateway.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from tests.factories import EOS_TOKEN_ID, TINY_VOCAB, write_byte_tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer(builtin_model_path: Path) -> Tokenizer:
    return Tokenizer.from_model_path(builtin_model_path)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(directory)
    return Tokenizer.from_model_path(directory)


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in token_ids]


# -- incremental detokenization -----------------------------------------------------------------

MULTIBYTE_TEXTS = [
    "Emoji: 😀👍🏽👨\u200d👩\u200d👧 ✨ done",
    "日本語のテキストと中文混合，标点。",
    "Café naïve façade, Ünïcödé résumé à Ørsted",
    "Ελληνικά и русский текст ✓ ∑ ≈ π",
    "mixed: a😀b日c é\n\tend",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_streams_whole_characters(smol_tokenizer: Tokenizer, text: str) -> None:
    tok = smol_tokenizer
    prompt = tok.encode("Write something:")
    ids = tok.encode(" " + text)
    detok = IncrementalDetokenizer(tok, prompt)
    chunks = stream(detok, ids)
    chunks.append(detok.flush())
    assert "".join(chunks) == tok.decode(ids) == " " + text
    for chunk in chunks:
        assert REPLACEMENT_CHAR not in chunk
    assert detok.flush() == ""


@pytest.mark.parametrize("prompt_text", ["日本語の", "emoji 😀👍🏽", ""])
def test_detokenizer_prompt_context_ending_in_multibyte_text(
    smol_tokenizer: Tokenizer, prompt_text: str
) -> None:
    """The first delta is decoded against the last prompt tokens, which may start mid-character."""
    tok = smol_tokenizer
    prompt = tok.encode(prompt_text)
    ids = tok.encode("テキスト😀 ok")
    detok = IncrementalDetokenizer(tok, prompt)
    chunks = stream(detok, ids)
    assert "".join(chunks) == "テキスト😀 ok"
    assert all(REPLACEMENT_CHAR not in c for c in chunks)


def test_detokenizer_test_texts_really_split_characters(smol_tokenizer: Tokenizer) -> None:
    """Guard for the test above: token by token, these texts do decode to partial characters,
    so a detokenizer that decoded each token alone would fail it."""
    tok = smol_tokenizer
    for text in MULTIBYTE_TEXTS[:2]:
        ids = tok.encode(" " + text)
        assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in ids), text
        detok = IncrementalDetokenizer(tok, [])
        assert "" in stream(detok, ids)  # some characters were held back


def test_detokenizer_after_a_chat_prompt(smol_tokenizer: Tokenizer) -> None:
    tok = smol_tokenizer
    prompt = tok.encode_chat([ChatMessage("user", "Say hi in Japanese")])
    ids = tok.encode("こんにちは! 😀") + tok.encode("<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt)
    chunks = stream(detok, ids)
    assert "".join(chunks) == "こんにちは! 😀"  # the special EOS token is skipped
    assert all(REPLACEMENT_CHAR not in c for c in chunks)


def test_detokenizer_byte_tokens_exact_chunks(byte_tokenizer: Tokenizer) -> None:
    text = "aé😀b"
    ids = list(text.encode())
    assert byte_tokenizer.encode(text) == ids
    detok = IncrementalDetokenizer(byte_tokenizer, list(b"prompt: "))
    assert stream(detok, ids) == ["a", "", "é", "", "", "", "😀", "b"]
    assert detok.flush() == ""


def test_detokenizer_several_tokens_at_once(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    emoji = list("😀".encode())
    assert detok.add([ord("x"), *emoji[:2]]) == ""  # the x waits for the partial emoji
    assert detok.add(emoji[2:]) == "x😀"
    assert detok.add([ord("!")]) == "!"


def test_detokenizer_flush_releases_a_trailing_partial_character(
    byte_tokenizer: Tokenizer,
) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    assert detok.add([ord("o"), ord("k")]) == "ok"
    assert detok.add(list("é".encode())[:1]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.flush() == ""


# -- stop strings -------------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[tuple[str, bool]]:
    return [matcher.feed(d) for d in deltas]


def test_stop_string_split_across_deltas() -> None:
    m = StopStringMatcher(["###"])
    assert feed_all(m, ["Hello #", "#", "# tail"]) == [
        ("Hello ", False),
        ("", False),
        ("", True),
    ]


def test_stop_string_inside_one_delta_drops_the_rest() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.matched is None
    assert m.feed("before STOP after STOP") == ("before ", True)
    assert m.matched == "STOP"


def test_the_earliest_stop_string_is_the_one_matched() -> None:
    m = StopStringMatcher(["after", "fore"])
    assert m.feed("before after") == ("be", True) and m.matched == "fore"


def test_held_prefix_released_when_not_a_stop() -> None:
    m = StopStringMatcher(["STOP"])
    assert feed_all(m, ["ab ST", "ART", " S", "x"]) == [
        ("ab ", False),
        ("START", False),
        (" ", False),
        ("Sx", False),
    ]
    assert m.flush() == ""


def test_held_prefix_then_stop_later_in_the_delta() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("a S") == ("a ", False)
    assert m.feed("x STOP y") == ("Sx ", True)


def test_stop_string_at_the_start() -> None:
    m = StopStringMatcher(["<|end|>"])
    assert feed_all(m, ["<|en", "d|>more"]) == [("", False), ("", True)]


def test_earliest_stop_string_wins() -> None:
    assert StopStringMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    assert StopStringMatcher(["b", "a"]).feed("xab") == ("x", True)
    # The held "ab" could start either; "abc" completes first at position 0.
    m = StopStringMatcher(["bcd", "abc"])
    assert feed_all(m, ["xab", "cd"]) == [("x", False), ("", True)]


def test_multiple_stop_strings_hold_a_prefix_of_any() -> None:
    m = StopStringMatcher(["\n\n", "User:"])
    assert feed_all(m, ["Answer.\n", "Us", "er", ": hi"]) == [
        ("Answer.", False),
        ("\n", False),
        ("", False),
        ("", True),
    ]


def test_stop_flush_returns_held_text_once() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("text </") == ("text ", False)
    assert m.flush() == "</"
    assert m.flush() == ""


def test_unicode_stop_string() -> None:
    m = StopStringMatcher(["。終"])
    assert feed_all(m, ["日本語。", "終わり"]) == [("日本語", False), ("", True)]


def test_empty_stop_strings_are_ignored() -> None:
    m = StopStringMatcher(["", "x"])
    assert m.stop == ["x"]
    assert m.feed("abx") == ("ab", True)
    passthrough = StopStringMatcher([""])
    assert passthrough.feed("anything") == ("anything", False)
    assert passthrough.flush() == ""


# -- tokenizer ----------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip(byte_tokenizer: Tokenizer) -> None:
    tok = byte_tokenizer
    assert tok.vocab_size == TINY_VOCAB
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == (None, "<|im_end|>", False)
    text = "héllo, 世界 😀\n\t  end"
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    with_special = tok.encode("a<|im_end|>b")
    assert with_special == [ord("a"), EOS_TOKEN_ID, ord("b")]
    assert tok.decode(with_special) == "ab"
    assert tok.decode(with_special, skip_special_tokens=False) == "a<|im_end|>b"
    # Out-of-vocabulary ids are dropped, not an error.
    assert tok.decode([ord("a"), TINY_VOCAB, -1, ord("b")]) == "ab"


def test_byte_tokenizer_chat_template(byte_tokenizer: Tokenizer) -> None:
    tok = byte_tokenizer
    messages = [ChatMessage("system", "S"), ChatMessage("user", "hi")]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    start, end = 257, 258
    assert tok.encode_chat(messages) == [
        start,
        *b"system\nS",
        end,
        ord("\n"),
        start,
        *b"user\nhi",
        end,
        ord("\n"),
        start,
        *b"assistant\n",
    ]


def test_no_chat_template_is_a_chat_template_error(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = Tokenizer.from_model_path(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([ChatMessage("user", "hi")])


HF_TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The year 2024 had 365 days; π ≈ 3.14159 and 1234567890.",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\r\nend",
    "multiple     spaces and\n\n\n\nnewlines   \n",
    "日本語のテキストと中文混合",
    "Emoji: 😀👍🏽👨\u200d👩\u200d👧 ✨",
    "Café naïve façade Ünïcödé Ελληνικά и русский",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text after<|endoftext|>",
    "I'm sure you'll've DON'T it's",
    "https://example.com/path?query=1&x=y#frag",
    '{"json": [1, 2.5, {"k": null}], "s": "\\u00e9"}',
    "0.001 -42 1e10 3,000,000 12:30",
    "<|im_start|>",
]

HF_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🤔"},
    ],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "日本語で\n  答えて"},
    ],
]


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(
    smol_tokenizer: Tokenizer, builtin_model_path: Path
) -> None:
    import transformers  # a dev dependency: the reference, imported only by this slow test

    hf = transformers.AutoTokenizer.from_pretrained(
        str(builtin_model_path.parent), gguf_file=builtin_model_path.name
    )
    tok = smol_tokenizer
    assert tok.vocab_size == len(hf)
    for text in HF_TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    for chat in HF_CHATS:
        messages = [ChatMessage(m["role"], m["content"]) for m in chat]
        for gen in (True, False):
            text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(messages, add_generation_prompt=gen) == text
        hf_ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        if not isinstance(hf_ids, list):
            hf_ids = hf_ids["input_ids"]
        assert tok.encode_chat(messages) == hf_ids
