"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs): the logprob, rank and
top-k of each prompt token under the model, from the hidden states a prefill chunk computes
anyway. The runner (engine/step/runner.py) calls `score_prompts` after a step's forward and
adds the scores to the step's output (engine/contract/contract.py's `PromptScores.add_to`).

A row whose request asked scores its scheduled positions that predict a prompt token:

    token_ids: |<- computed ->|<- scheduled now ------->|<- rest ->|
    scored:                   |p ... min(end, P - 1) - 1|           (P: num_prompt_tokens)

position p's logits give the logprob of token_ids[p + 1]; the last prompt position predicts
the first generated token (the sampler's), so it is not scored, and the first prompt token is
predicted by nothing (null to the client). Chunked prefill returns each chunk's positions.
"""

from __future__ import annotations

import torch

from llmserve.engine.contract.contract import PromptScores
from llmserve.engine.contract.mirror import StepBatch
from llmserve.engine.step.sampler import to_device

# Positions scored per logits matrix: bounds the [positions, vocab] float32 temporaries
# (256 x 152k vocab = 156 MB) whatever the chunk size.
SLICE_POSITIONS = 256


def scored_positions(batch: StepBatch, cu_seqlens_q: list[int]) -> tuple[list[int], list[int]]:
    """Per batch row, the flattened hidden-state index of each position it scores, and the
    prompt token that position predicts, row after row; ([], []) when no row asked."""
    index: list[int] = []
    targets: list[int] = []
    for i, row in enumerate(batch.rows):
        seq = row.seq
        if seq.prompt_logprobs < 0:
            continue
        end = min(row.end, seq.num_prompt_tokens - 1)
        for p in range(row.start, end):
            index.append(cu_seqlens_q[i] + p - row.start)
            targets.append(seq.token_ids[p + 1])
    return index, targets


@torch.inference_mode()
def score_prompts(
    model: torch.nn.Module, hidden: torch.Tensor, batch: StepBatch, cu_seqlens_q: list[int]
) -> PromptScores | None:
    """The prompt scores of batch's rows that asked (None when none did), from the step's final
    hidden states. Waits for the device (a step that scores prompts does not overlap the next:
    only prefill chunks of requests that asked pay it)."""
    rows = batch.rows
    if not any(r.seq.prompt_logprobs >= 0 for r in rows):
        return None
    counts = []
    for r in rows:
        asked = r.seq.prompt_logprobs >= 0
        counts.append(max(0, min(r.end, r.seq.num_prompt_tokens - 1) - r.start) if asked else 0)
    scores = PromptScores(counts)
    index, targets = scored_positions(batch, cu_seqlens_q)
    top_k = [r.seq.prompt_logprobs for r, n in zip(rows, counts, strict=True) for _ in range(n)]
    for lo in range(0, len(index), SLICE_POSITIONS):
        hi = lo + SLICE_POSITIONS
        _score_slice(model, hidden, index[lo:hi], targets[lo:hi], top_k[lo:hi], scores)
    return scores


def _score_slice(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    index: list[int],
    targets: list[int],
    top_k: list[int],
    scores: PromptScores,
) -> None:
    """Score positions `index` of hidden (predicting `targets`, top_k[j] alternatives each) into
    scores: log_softmax of the unmodified logits in float32, as the sampler's logprobs."""
    device = hidden.device
    logits = model.compute_logits(hidden[to_device(index, torch.long, device)])
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = to_device(targets, torch.long, device).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    scores.logprobs += chosen.squeeze(1).tolist()
    scores.ranks += ranks.tolist()
    k = max(top_k)
    if k == 0:
        return
    top_lps, top_ids = logprobs.topk(k, dim=1)
    for j, (ids, lps) in enumerate(zip(top_ids.tolist(), top_lps.tolist(), strict=True)):
        scores.top_token_ids += ids[: top_k[j]]
        scores.top_logprobs += lps[: top_k[j]]
