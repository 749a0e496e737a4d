"""A SentencePiece tokenizer stored in a GGUF (`tokenizer.ggml.model = "llama"`: llama.cpp's
conversions of Llama 2, Mistral up to v0.3, Mixtral, Gemma and Phi-3) rebuilt with the
`tokenizers` library, no sentencepiece needed at run time.

SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
highest-scoring piece; a `tokenizers` BPE whose merges are ranked by that score (best first)
makes the same choices. Characters no piece covers fall back to the `<0xXX>` byte pieces. Spaces
are the `▁` piece character, with one put before the text unless the file says
`tokenizer.ggml.add_space_prefix = false` (Gemma); decoding undoes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"
# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two pieces of the vocabulary, ranked by
    the whole piece's score (highest first; one piece's splits by the left, then the right
    piece's id)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types and types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]


def spm_tokenizer(fields: Mapping[str, Any]) -> HFTokenizer:
    """The `tokenizers` tokenizer of a GGUF's SentencePiece vocabulary (its metadata fields)."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    scores: list[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types: list[int] = fields.get("tokenizer.ggml.token_type") or []
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and _UNKNOWN in types:
        unk_id = types.index(_UNKNOWN)
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens, scores, types),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = HFTokenizer(bpe)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # The space before the text always (as SentencePiece and llama.cpp put it, also before a
    # text that starts with spaces), and before each text after a special token (llama.cpp's).
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )
    return tokenizer
