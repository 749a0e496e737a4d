"""The prompt's logprobs in the HTTP formats (docs/api.md#prompt-logprobs): OpenAI's legacy
`echo` with `logprobs` (the prompt's tokens before the completion's in the choice's logprobs)
and vLLM's `prompt_logprobs` (a list per prompt position of {token id: {logprob, rank,
decoded_token}}). Both read a choice's first GenerateResponse, which carries the prompt's token
ids and their scores (protos/api.proto); the first prompt token has none (null), as in both.
"""

from __future__ import annotations

import math

from llmserve.gateway.detokenizer import IncrementalDetokenizer
from llmserve.gateway.openai_protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.protos import api_pb2, common_pb2

# OpenAI's stand-in for a logprob too small to print (gateway/openai_responses.py's too).
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def token_text(data: bytes) -> str:
    """A token's text, or OpenAI's "bytes:\\xe4\\xb8" for a token that is part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _top(msg: api_pb2.GenerateResponse, j: int, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) at prompt token j's position (j >= 1)."""
    if k == 0 or j - 1 >= len(msg.prompt_top_logprobs):
        return []
    ranked = msg.prompt_top_logprobs[j - 1]
    return list(zip(ranked.token_ids[:k], ranked.logprobs[:k], strict=True))


def echo_logprobs(
    tokenizer: Tokenizer, msg: api_pb2.GenerateResponse, k: int
) -> CompletionLogprobs:
    """The legacy logprobs of the prompt (msg: a choice's first message): each token's text,
    logprob, its k most likely alternatives (and itself, as OpenAI lists the chosen token) and
    its character offset in the prompt's text; null logprob and top_logprobs first."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    detok = IncrementalDetokenizer(tokenizer, [])
    num_chars = 0
    for j, token_id in enumerate(msg.prompt_token_ids):
        token = token_text(tokenizer.token_bytes(token_id))
        out.tokens.append(token)
        out.text_offset.append(num_chars)
        num_chars += len(detok.add([token_id]))
        if j == 0 or j - 1 >= len(msg.prompt_logprobs):
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        logprob = finite(msg.prompt_logprobs[j - 1])
        top: dict[str, float] = {}
        for top_id, top_lp in _top(msg, j, k):
            top.setdefault(token_text(tokenizer.token_bytes(top_id)), finite(top_lp))
        top.setdefault(token, logprob)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
    return out


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, msg: api_pb2.GenerateResponse, k: int
) -> PromptLogprobs:
    """vLLM's prompt_logprobs of msg (a choice's first message): per prompt position the
    prompt's token then the k most likely (rank 1 first), null for the first position."""
    out: PromptLogprobs = [None] if msg.prompt_token_ids else []
    ids = msg.prompt_token_ids[1:]
    scored = zip(ids, msg.prompt_logprobs, msg.prompt_logprob_ranks, strict=True)
    for j, (token_id, logprob, rank) in enumerate(scored, start=1):
        ranked = [(token_id, logprob, rank)]
        ranked += [(t, lp, r) for r, (t, lp) in enumerate(_top(msg, j, k), start=1)]
        entry: dict[int, PromptLogprob] = {}
        for t, lp, r in ranked:
            text = tokenizer.decode([t], skip_special_tokens=False)
            entry.setdefault(t, PromptLogprob(logprob=finite(lp), rank=r, decoded_token=text))
        out.append(entry)
    return out


def prompt_only(msg: api_pb2.GenerateResponse) -> api_pb2.GenerateResponse:
    """msg without what was generated (max_tokens 0 with echo: one token is generated, as the
    step contract always samples, and dropped here); it ends as "length"."""
    out = api_pb2.GenerateResponse()
    out.CopyFrom(msg)
    for name in ("text", "token_ids", "logprobs", "top_logprobs", "stop_string"):
        out.ClearField(name)  # type: ignore[arg-type]
    if out.finish_reason:
        out.finish_reason = common_pb2.FINISH_REASON_LENGTH
        out.usage.completion_tokens = 0
    return out
