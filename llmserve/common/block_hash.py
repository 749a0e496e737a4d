"""The prefix cache's block hash rule, shared by the scheduler (which caches blocks by it) and the
gateway (which routes a prompt to the replica that already holds its first blocks).

    tokens:  |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- partial: no hash ->|
    hashes:   h0 = H(0, b0)  h1 = H(h0, b1)  h2 = H(h1, b2)

A hash names a block's whole prefix. Python's hash of a tuple of ints is the same in every
process, so the gateway and the scheduler agree without sharing state. Under a LoRA adapter the
chain starts from the adapter version's root (`lora_hash_root`) instead of 0, so a block is never
a hit for another adapter, another version of it, or the base.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of a block of token_ids whose previous block hashed to parent (0 for none)."""
    return hash((parent, tuple(token_ids)))


@cache
def lora_hash_root(lora_name: str) -> int:
    """The parent hash of the first block of a request under adapter lora_name (0: the base)."""
    if not lora_name:
        return 0
    digest = hashlib.blake2b(lora_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    root: int = 0,
) -> list[int]:
    """Append to hashes (those of token_ids' first len(hashes) blocks) the hashes of its blocks up
    to num_blocks; num_blocks must not exceed the full blocks of token_ids. root: the first
    block's parent (lora_hash_root). Returns hashes."""
    assert block_size > 0 and num_blocks * block_size <= len(token_ids)
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = None, root: int = 0
) -> list[int]:
    """The chained hashes of token_ids' full blocks (at most max_blocks of them), in order,
    from root (see extend_block_hashes)."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    return extend_block_hashes([], token_ids, block_size, num_blocks, root)
