"""Token trees (SpecInfer): speculation that proposes several continuations at once, verified in
one forward with a tree attention mask, keeping the longest path the target agrees with.

A row's proposals are its tree's nodes, `row.draft_token_ids`, with `row.draft_parents[i]` the
index of node i's parent (-1: the row's last known token, the root); parents come before their
children. An empty `draft_parents` is a chain (node i's parent is i - 1), which is what every
chain proposer makes. Node 0, 1, ... while parent[i] == i - 1 is the tree's *main chain* (the
proposer's best guess; the draft model's KV holds it).

The verification forward stores node i's K/V at storage position end + i (inside the row's
lookahead slots, end = the row's known tokens) with rotary position end - 1 + depth(i), and node
i attends to the row's known tokens and its own ancestors only:

        tree:  root -> a -> b             storage: | known ... | a | b | c | d |
                    \\-> c -> d           a sees known + a; b: + a, b; c: + c; d: + c, d

Every node is sampled from the target (as a chain's positions are); walking down from the root,
the child whose token equals the sample at its parent is followed. With deterministic proposals
(the n-gram match, the draft's top tokens) this is SpecInfer's multi-step speculative sampling:
each kept token is a draw from the target's distribution given the path before it, and a seeded
row draws at every node of depth d with the key of output index d, as decoding without proposals
does. After the walk the accepted nodes' K/V moves to consecutive positions (end, end + 1, ...),
and the rest of the lookahead slots are released as a chain's rejected ones are.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

_TOKEN_BYTES = array("i").itemsize


def chain_parents(num_nodes: int) -> list[int]:
    return list(range(-1, num_nodes - 1))


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the root)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root's first child down to node (included; [] for node -1)."""
    out: list[int] = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: [i, j] when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def row_attention(
    num_known: int, start: int, parents: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [num_q, seq_len], key positions [seq_len]) of a row whose queries are its known
    tokens [start, num_known) then its tree's nodes (stored at num_known + i): a known token
    attends causally, a node to every known token and its own ancestors. Key positions are
    rotary positions (the sliding window compares them)."""
    n = len(parents)
    seq_len = num_known + n
    num_q = num_known - start + n
    depths = torch.tensor(node_depths(parents), dtype=torch.long)
    k_pos = torch.cat([torch.arange(num_known), num_known - 1 + depths])
    mask = torch.zeros((num_q, seq_len), dtype=torch.bool)
    known_q = torch.arange(start, num_known)
    mask[: num_known - start, :num_known] = torch.arange(num_known)[None, :] <= known_q[:, None]
    mask[num_known - start :, :num_known] = True
    mask[num_known - start :, num_known:] = ancestor_mask(parents)
    return mask, k_pos


def accept_path(sampled: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """The accepted nodes, root first: from the root, follow the child whose token equals the
    token sampled at the current node (sampled[0] at the root, sampled[1 + i] at node i)."""
    children: dict[tuple[int, int], int] = {}
    for i in range(len(tokens) - 1, -1, -1):  # the first of equal siblings wins
        children[(parents[i], tokens[i])] = i
    path: list[int] = []
    node = -1
    while (child := children.get((node, sampled[node + 1]))) is not None:
        path.append(child)
        node = child
    return path


def main_chain_prefix(path: list[int], parents: list[int]) -> int:
    """How many of path's first nodes lie on the main chain (nodes 0, 1, ... with parent i - 1)."""
    n = 0
    while n < len(path) and path[n] == n and parents[n] == n - 1:
        n += 1
    return n


def tree_depth(parents: list[int]) -> int:
    return max(node_depths(parents), default=0)


def _matches(token_ids: list[int], n: int, limit: int) -> list[int]:
    """Start indices of the continuations after earlier occurrences of token_ids' last n tokens,
    latest first, at most limit (a match ends before the last token)."""
    data = array("i", token_ids).tobytes()
    length = len(token_ids)
    pattern = data[(length - n) * _TOKEN_BYTES :]
    end = (length - 1) * _TOKEN_BYTES
    found: list[int] = []
    while len(found) < limit and (at := data.rfind(pattern, 0, end)) >= 0:
        end = at + len(pattern) - 1
        if at % _TOKEN_BYTES == 0:
            found.append(at // _TOKEN_BYTES + n)
    return found


def ngram_tree(
    token_ids: list[int], num_nodes: int, depth: int, width: int, ngram_min: int, ngram_max: int
) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a tree of at most num_nodes nodes and depth: the continuations (up to
    depth tokens) after the latest earlier matches of the last n tokens, n from ngram_max down
    to ngram_min, merged into a trie, until width of them have added a branch. The first
    continuation found (ngram_match's chain) is the main chain."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    branches = 0
    for n in range(min(ngram_max, len(token_ids) - 1), ngram_min - 1, -1):
        for start in _matches(token_ids, n, 4 * width):
            node, added = -1, False
            for token in token_ids[start : start + depth]:
                child = index.get((node, token))
                if child is None:
                    if len(tokens) == num_nodes:
                        break
                    child = index[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    added = True
                node = child
            branches += added
            if branches == width or len(tokens) == num_nodes:
                return tokens, parents
    return tokens, parents


def with_siblings(
    chain: list[int], alternatives: list[list[int]], num_nodes: int
) -> tuple[list[int], list[int]]:
    """A draft's tree: its chain (node i at depth i + 1), then alternatives[i] (the draft's next
    best tokens where it chose chain[i]) as leaves beside chain[i], shallowest first, while
    num_nodes allows."""
    tokens, parents = list(chain), chain_parents(len(chain))
    for i, alts in enumerate(alternatives[: len(chain)]):
        for token in alts:
            if len(tokens) == num_nodes:
                return tokens, parents
            if token != chain[i]:
                tokens.append(token)
                parents.append(i - 1)
    return tokens, parents


def node_bits(parents: list[int]) -> list[int]:
    """Per node, its ancestors and itself as bits (bit j: node j), as signed 64-bit values."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    return [b - (1 << 64) if b >> 63 else b for b in bits]


def tree_kernel_args(rows: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA prefill kernel's (tree_bits [tokens] int64, tree_start [rows] int32) for a
    step's rows (engine/contract/mirror.py ScheduledSeq; prefill_attention.cu's header)."""
    bits: list[int] = []
    starts: list[int] = []
    for row in rows:
        bits.extend([0] * row.num_scheduled_tokens)
        if row.draft_parents:
            bits.extend(node_bits(row.draft_parents))
            starts.append(row.end)
        else:
            bits.extend([0] * len(row.draft_token_ids))
            starts.append(1 << 30)  # past every key
    return (
        torch.tensor(bits, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
    )


def compact_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    moves: list[tuple[int, int]],
) -> None:
    """Copy K/V slot src to slot dst for every (src, dst) in moves, in every layer (all sources
    are read before any is written)."""
    if not moves:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        for cache in (k_cache, v_cache):
            flat = cache.view(-1, *cache.shape[2:])
            raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat
            raw[dst] = raw[src]
