"""gateway.validation.validate: every bad field is refused with a message naming the field, the
value and the limit; valid requests come back tokenized with their defaults filled in."""

from __future__ import annotations

import math
from typing import Any

import pytest

from llmserve.gateway.tokenizer import Tokenizer
from llmserve.gateway.validation import Limits, ValidationError, ValidRequest, validate
from llmserve.protos import api_pb2, scheduler_pb2
from llmserve.protos.common_pb2 import SamplingParams
from tests.factories import write_byte_tokenizer

LIMITS = Limits(max_model_len=64, vocab_size=259, kv_capacity_tokens=1024)
IM_START, IM_END = 257, 258


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(directory)
    return Tokenizer.from_model_path(directory)


def request(**fields: Any) -> api_pb2.GenerateRequest:
    """A GenerateRequest with a short text prompt unless the fields give a prompt; sampling
    fields (temperature, seed, ...) go into its `sampling`."""
    if "text" not in fields and "chat" not in fields and fields.pop("no_prompt", False) is False:
        fields["text"] = "hello"
    names = SamplingParams.DESCRIPTOR.fields_by_name
    sampling = SamplingParams(**{k: fields.pop(k) for k in list(fields) if k in names})
    return api_pb2.GenerateRequest(sampling=sampling, **fields)


def chat(*messages: tuple[str, str]) -> api_pb2.ChatPrompt:
    return api_pb2.ChatPrompt(
        messages=[api_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )


def error(req: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits = LIMITS) -> str:
    with pytest.raises(ValidationError) as err:
        validate(req, tokenizer, limits)
    return str(err.value)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# -- sampling fields ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"temperature": -0.5}, ["temperature=-0.5", "finite", ">= 0"]),
        ({"temperature": math.nan}, ["temperature=nan", "finite", ">= 0"]),
        ({"temperature": math.inf}, ["temperature=inf", "finite", ">= 0"]),
        ({"temperature": -math.inf}, ["temperature=-inf", "finite", ">= 0"]),
        ({"top_p": 0.0}, ["top_p=0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ["top_p=1.5", "(0, 1]"]),
        ({"top_p": -0.25}, ["top_p=-0.25", "(0, 1]"]),
        ({"top_p": math.nan}, ["top_p=nan", "(0, 1]"]),
        ({"top_k": -2}, ["top_k=-2", ">= -1"]),
        ({"min_p": -0.1}, ["min_p=-0.1", "[0, 1]"]),
        ({"min_p": 1.1}, ["min_p=1.1", "[0, 1]"]),
        ({"min_p": math.nan}, ["min_p=nan", "[0, 1]"]),
        ({"max_tokens": 0}, ["max_tokens=0", ">= 1"]),
        ({"max_tokens": -1}, ["max_tokens=-1", ">= 1"]),
    ],
)
def test_bad_sampling_field(
    tokenizer: Tokenizer, fields: dict[str, Any], expected: list[str]
) -> None:
    message = error(request(**fields), tokenizer)
    for part in expected:
        assert part in message


@pytest.mark.parametrize("request_id", ["has space", "x" * 129, "semi;colon", "ünï"])
def test_bad_request_id(tokenizer: Tokenizer, request_id: str) -> None:
    message = error(request(request_id=request_id), tokenizer)
    assert message.startswith("request_id")
    assert "1-128 characters" in message


def test_bad_request_id_message_names_the_value(tokenizer: Tokenizer) -> None:
    # Every other field's message carries the value the client sent (house style: field, value,
    # limit); the request_id one does not, which leaves the client guessing which id was wrong.
    message = error(request(request_id="has space"), tokenizer)
    assert "has space" in message


@pytest.mark.parametrize("request_id", ["a", "x" * 128, "abc-1.2:3_X"])
def test_good_request_id(tokenizer: Tokenizer, request_id: str) -> None:
    validate(request(request_id=request_id), tokenizer, LIMITS)


# -- prompt -------------------------------------------------------------------------------------


def test_missing_prompt(tokenizer: Tokenizer) -> None:
    message = error(request(no_prompt=True, max_tokens=4), tokenizer)
    assert message == "prompt is missing: set text, chat or token_ids"


def test_empty_text(tokenizer: Tokenizer) -> None:
    # An empty string still selects the oneof's text case.
    req = api_pb2.GenerateRequest(text="")
    assert req.WhichOneof("prompt") == "text"
    assert error(req, tokenizer) == "text is empty"


def test_empty_chat(tokenizer: Tokenizer) -> None:
    req = api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt())
    assert req.WhichOneof("prompt") == "chat"
    assert error(req, tokenizer) == "chat.messages is empty"


def test_bad_role(tokenizer: Tokenizer) -> None:
    req = request(chat=chat(("user", "hi"), ("robot", "beep")))
    message = error(req, tokenizer)
    assert "chat.messages[1].role='robot'" in message
    assert "('system', 'user', 'assistant', 'tool')" in message


def test_text_over_the_character_limit(tokenizer: Tokenizer) -> None:
    limits = Limits(max_model_len=64, vocab_size=259, kv_capacity_tokens=1024, max_prompt_chars=10)
    message = error(request(text="x" * 11), tokenizer, limits)
    assert message == "text has 11 characters; the limit is 10"
    message = error(request(chat=chat(("user", "x" * 6), ("user", "y" * 5))), tokenizer, limits)
    assert message == "chat.messages have 11 characters; the limit is 10"


def test_prompt_over_the_context(tokenizer: Tokenizer) -> None:
    message = error(request(text="x" * 64), tokenizer)
    assert message == (
        "prompt has 64 tokens; the limit is 63 (max_model_len=64, one token left to generate). "
        "This model's maximum context length is 64 tokens."
    )
    # 63 tokens leave exactly one to generate.
    assert validate(request(text="x" * 63), tokenizer, LIMITS).submit.max_tokens == 1


def test_prompt_over_the_kv_capacity(tokenizer: Tokenizer) -> None:
    limits = Limits(max_model_len=64, vocab_size=259, kv_capacity_tokens=32)
    message = error(request(text="x" * 40), tokenizer, limits)
    assert "prompt has 40 tokens; the limit is 31" in message
    assert "the KV cache holds 32 tokens" in message
    message = error(request(text="x" * 30, max_tokens=3), tokenizer, limits)
    assert "max_tokens=3 exceeds the model's remaining context of 2 tokens" in message
    assert "the KV cache holds 32 tokens" in message


def test_max_tokens_over_the_remaining_context(tokenizer: Tokenizer) -> None:
    message = error(request(text="x" * 10, max_tokens=55), tokenizer)
    assert message == (
        "max_tokens=55 exceeds the model's remaining context of 54 tokens "
        "(max_model_len=64, prompt 10 tokens). This model's maximum context length is 64 tokens."
    )
    assert (
        validate(request(text="x" * 10, max_tokens=54), tokenizer, LIMITS).submit.max_tokens == 54
    )


def test_prompt_logprobs_fields(tokenizer: Tokenizer) -> None:
    """gRPC's prompt_logprobs reach the scheduler; the top-k is 0..20 and needs the flag."""
    ok = validate(request(prompt_logprobs=True, prompt_top_logprobs=20), tokenizer, LIMITS)
    assert ok.submit.prompt_logprobs and ok.submit.prompt_top_logprobs == 20
    message = error(request(prompt_logprobs=True, prompt_top_logprobs=21), tokenizer)
    assert message == "prompt_top_logprobs=21 must be in [0, 20]"
    message = error(request(prompt_top_logprobs=2), tokenizer)
    assert message == "prompt_top_logprobs needs prompt_logprobs=true"


def test_chat_prompt_over_the_context(tokenizer: Tokenizer) -> None:
    # The template adds 19 tokens around the content: 3 specials, "\n", "user\n", "assistant\n".
    ok = validate(request(chat=chat(("user", "x" * 44))), tokenizer, LIMITS)
    assert len(ok.prompt_token_ids) == 63
    message = error(request(chat=chat(("user", "x" * 45))), tokenizer)
    assert message.startswith("prompt has 64 tokens; the limit is 63")


# -- stops --------------------------------------------------------------------------------------


def test_too_many_stop_strings(tokenizer: Tokenizer) -> None:
    message = error(request(stop=[f"s{i}" for i in range(17)]), tokenizer)
    assert message == "stop has 17 strings; at most 16 are allowed"
    assert validate(request(stop=[f"s{i}" for i in range(16)]), tokenizer, LIMITS).stop == [
        f"s{i}" for i in range(16)
    ]


def test_empty_stop_string(tokenizer: Tokenizer) -> None:
    assert error(request(stop=["ok", ""]), tokenizer) == "stop[1] is empty"


def test_stop_string_too_long(tokenizer: Tokenizer) -> None:
    message = error(request(stop=["a", "b" * 257]), tokenizer)
    assert message == "stop[1] has 257 characters; the limit is 256"


@pytest.mark.parametrize(("token_id", "index"), [(259, 1), (-1, 1), (100000, 1)])
def test_stop_token_ids_outside_the_vocabulary(
    tokenizer: Tokenizer, token_id: int, index: int
) -> None:
    message = error(request(stop_token_ids=[258, token_id]), tokenizer)
    assert message == (f"stop_token_ids[{index}]={token_id} is outside the vocabulary [0, 259)")


# -- unknown fields -----------------------------------------------------------------------------


def test_unknown_field(tokenizer: Tokenizer) -> None:
    data = request(max_tokens=4).SerializeToString()
    data += varint(42 << 3 | 0) + varint(7)  # field 42, wire type varint, value 7
    req = api_pb2.GenerateRequest.FromString(data)
    assert req.text == "hello" and req.max_tokens == 4
    message = error(req, tokenizer)
    assert "unknown field number 42" in message
    assert "GenerateRequest" in message


def test_unknown_field_inside_a_chat_message(tokenizer: Tokenizer) -> None:
    # A newer client's ChatMessage field (say a `name`, number 9) is as unknown to this server as
    # a top-level one, and would be dropped just as silently.
    raw = api_pb2.ChatMessage(role="user", content="hi").SerializeToString()
    raw += varint(9 << 3 | 2) + varint(3) + b"bob"  # field 9, length-delimited, "bob"
    message_with_extra = api_pb2.ChatMessage.FromString(raw)
    req = api_pb2.GenerateRequest(chat=api_pb2.ChatPrompt(messages=[message_with_extra]))
    req = api_pb2.GenerateRequest.FromString(req.SerializeToString())
    message = error(req, tokenizer)
    assert "unknown field number 9" in message


# -- valid requests -----------------------------------------------------------------------------


def test_defaults_filled(tokenizer: Tokenizer) -> None:
    valid = validate(request(text="hello"), tokenizer, LIMITS)
    submit = scheduler_pb2.SubmitRequest(
        prompt_token_ids=list(b"hello"),
        max_tokens=64 - 5,
        sampling=SamplingParams(temperature=1.0, top_p=1.0),
    )
    assert valid == ValidRequest(submit, stop=[])
    assert not valid.sampling.HasField("seed")


def test_explicit_fields_kept(tokenizer: Tokenizer) -> None:
    fields: dict[str, Any] = {
        "temperature": 0.0, "top_k": 40, "top_p": 0.5, "min_p": 1.0, "seed": 2**64 - 1,
        "logprobs": True,
    }  # fmt: skip
    valid = validate(
        request(
            text="hi",
            max_tokens=7,
            stop=["\n"],
            stop_token_ids=[258, 0],
            ignore_eos=True,
            request_id="abc-1.2:3_x",
            **fields,
        ),
        tokenizer,
        LIMITS,
    )
    submit = scheduler_pb2.SubmitRequest(
        prompt_token_ids=[ord("h"), ord("i")],
        max_tokens=7,
        sampling=SamplingParams(**fields),
        stop_token_ids=[258, 0],
        ignore_eos=True,
    )
    assert valid == ValidRequest(submit, stop=["\n"])


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off_values_accepted(tokenizer: Tokenizer, top_k: int) -> None:
    assert validate(request(top_k=top_k), tokenizer, LIMITS).sampling.top_k == top_k


def test_seed_zero_is_not_unset(tokenizer: Tokenizer) -> None:
    assert validate(request(seed=0), tokenizer, LIMITS).sampling.HasField("seed")
    assert validate(request(seed=12345), tokenizer, LIMITS).sampling.seed == 12345
    assert not validate(request(), tokenizer, LIMITS).sampling.HasField("seed")


def test_chat_template_rendered_and_tokenized(tokenizer: Tokenizer) -> None:
    valid = validate(request(chat=chat(("system", "Be brief."), ("user", "Hi"))), tokenizer, LIMITS)
    expected = [
        IM_START,
        *b"system\nBe brief.",
        IM_END,
        ord("\n"),
        IM_START,
        *b"user\nHi",
        IM_END,
        ord("\n"),
        IM_START,
        *b"assistant\n",
    ]
    assert valid.prompt_token_ids == expected
    assert valid.submit.max_tokens == 64 - len(expected)


def test_special_tokens_in_text_are_tokens(tokenizer: Tokenizer) -> None:
    valid = validate(request(text="<|im_start|>x"), tokenizer, LIMITS)
    assert valid.prompt_token_ids == [IM_START, ord("x")]


# -- penalties and top logprobs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"presence_penalty": 2.5}, "sampling.presence_penalty=2.5 must be in [-2, 2]"),
        ({"presence_penalty": -2.01}, "sampling.presence_penalty=-2.01 must be in [-2, 2]"),
        ({"frequency_penalty": math.nan}, "sampling.frequency_penalty=nan must be in [-2, 2]"),
        ({"frequency_penalty": math.inf}, "sampling.frequency_penalty=inf must be in [-2, 2]"),
        ({"logprobs": True, "top_logprobs": 21}, "sampling.top_logprobs=21 must be in [0, 20]"),
        ({"logprobs": True, "top_logprobs": -1}, "sampling.top_logprobs=-1 must be in [0, 20]"),
        ({"top_logprobs": 3}, "sampling.top_logprobs=3 needs sampling.logprobs=true"),
    ],
)
def test_bad_penalty_or_top_logprobs(
    tokenizer: Tokenizer, fields: dict[str, Any], expected: str
) -> None:
    assert error(request(**fields), tokenizer) == expected


def test_penalties_and_top_logprobs_kept(tokenizer: Tokenizer) -> None:
    valid = validate(
        request(presence_penalty=-2.0, frequency_penalty=2.0, logprobs=True, top_logprobs=20),
        tokenizer,
        LIMITS,
    )
    p = valid.sampling
    assert (p.presence_penalty, p.frequency_penalty) == (-2.0, 2.0)
    assert p.top_logprobs == 20 and p.logprobs
    d = validate(request(), tokenizer, LIMITS).sampling
    assert (d.presence_penalty, d.frequency_penalty, d.top_logprobs) == (0, 0, 0)
