"""How a decode step splits its contexts across the decode kernel's CTAs (split-K), fixed per
model shape so that CUDA graphs and eager steps compute the same sums."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) holding num_seqs rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodeSplits:
    """The decode kernel's split-K count as a function of what a step holds, the same whether a
    CUDA graph or an eager forward runs it.

    The count decides which tiles of a context each split owns (kernels/decode_attention.cu:
    tps = ceil(n_tiles / num_splits)) and so the order of the floating-point sums: two counts
    give results that differ in the last bits. A graph fixes its count when it is captured, for
    a padded batch size and without the step's lengths; so the count is chosen from what a
    graph knows and an eager step can reproduce: the number of requests rounded up to the
    graph batch sizes (`batch_sizes`, the engine's, used whether or not graphs are captured),
    and the context capacity `max_seq_len` (the engine's max_model_len), never from the batch's
    real longest context. kernels.cuda.decode_num_splits' cost model then picks the count for
    that padded batch on this GPU (`slots` = resident CTAs on the whole GPU). An eager step of
    n requests and the graph of the size n pads to launch the same count, so they compute the
    same sums; short contexts get more, shorter splits than their own length would pick, as the
    graphs always did.
    """

    max_seq_len: int
    batch_sizes: tuple[int, ...]  # ascending
    num_heads: int
    num_kv_heads: int
    slots: int

    def count(self, num_seqs: int) -> int:
        """The split count of a decode-only step of num_seqs requests (padded as a graph pads
        them; num_seqs itself beyond the largest graph)."""
        from llmserve.kernels.cuda import decode_ctas_per_seq, decode_num_splits

        padded = padded_batch_size(num_seqs, self.batch_sizes) or num_seqs
        num_ctas = decode_ctas_per_seq(self.num_heads, self.num_kv_heads) * padded
        return decode_num_splits(num_ctas, self.max_seq_len, self.slots)
