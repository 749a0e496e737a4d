"""The ground truth for every kernel, in plain torch. This is also what the CPU engine runs.

KV pool layout (one layer's half): `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`. Token slot `s` lives at block `s // block_size`, row `s % block_size`. The engine keeps
all layers in one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` and hands
each layer its two views.

Batch layout for attention: the step's query tokens are flattened, request after request:

    cu_seqlens_q:  0        q0          q0+q1              T
                   |<- r0 ->|<-   r1   ->|<- ... ->|
    request b:     |<------ context (already in the pool) ------>|<- this step's q_b tokens ->|
                   0                                seq_len_b - q_b                 seq_len_b

Query i of request b sits at position `seq_len_b - q_b + i` and sees keys 0..that position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write rows `key[t]`, `value[t]` ([T, num_kv_heads, head_dim]) to slot `slot_mapping[t]`.

    Slot -1 marks a padding row and is skipped. Modifies k_cache and v_cache in place.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k[slot_mapping] = key.to(flat_k.dtype)
    flat_v[slot_mapping] = value.to(flat_v.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` token rows of one request, `[seq_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    rows = cache.flatten(1).index_select(0, block_table[:num_blocks])  # [blocks, bs * Hkv * D]
    return rows.view(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole context in the paged pool.

    q: [T, num_heads, head_dim]; block_tables: [B, max_blocks_per_seq] (rows padded with any valid
    block id); seq_lens[b]: context length including this step's tokens; cu_seqlens_q: B+1 offsets
    into q. The step's own K/V must already be stored (store_kv) before the call. Returns
    [T, num_heads, head_dim] in q's dtype. GQA when num_heads is a multiple of num_kv_heads.

    Decode rows (one query) are batched together; each longer chunk runs on its own.
    """
    out = torch.empty_like(q)
    num_seqs = len(seq_lens)
    gqa = q.shape[1] != k_cache.shape[2]
    decode = [b for b in range(num_seqs) if cu_seqlens_q[b + 1] - cu_seqlens_q[b] == 1]
    if decode:
        _decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, decode, scale, out
        )
    for b in range(num_seqs):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        num_q = end - start
        if num_q <= 1:
            continue
        seq_len = seq_lens[b]
        k = gather_kv(k_cache, block_tables[b], seq_len).transpose(0, 1).unsqueeze(0)
        v = gather_kv(v_cache, block_tables[b], seq_len).transpose(0, 1).unsqueeze(0)
        qb = q[start:end].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        attn = F.scaled_dot_product_attention(
            qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One query per request in `rows`, batched: gather each context padded to the longest
    (one index_select per cache), then per KV head two strided bmm's over its query group, so K
    and V are neither repeated for GQA nor permuted into copies."""
    device = q.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_rows = len(rows)
    lens = torch.tensor([seq_lens[b] for b in rows], device=device)
    max_len = int(lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    index = block_tables[rows, :max_blocks].flatten()
    shape = (num_rows, max_blocks * block_size, num_kv_heads, head_dim)
    k = k_cache.flatten(1).index_select(0, index).view(shape).to(q.dtype)  # [B, L, Hkv, D]
    v = v_cache.flatten(1).index_select(0, index).view(shape).to(q.dtype)
    token_idx = torch.tensor([cu_seqlens_q[b] for b in rows], device=device)
    qg = q[token_idx].view(num_rows, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    hidden = (torch.arange(shape[1], device=device)[None, :] >= lens[:, None])[:, None, :]
    accumulate = torch.promote_types(q.dtype, torch.float32)  # fp32 for half types, else q's
    attn = torch.empty_like(qg)
    for h in range(num_kv_heads):
        scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) * scale  # [B, G, L]
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores.to(accumulate), dim=-1).to(q.dtype)
        attn[:, h] = torch.bmm(probs, v[:, :, h])
    out[token_idx] = attn.view(num_rows, -1, head_dim)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalized by its root mean square, times weight; returns (out, new residual).

    Computed in float32 and cast back, as HF's LlamaRMSNorm does. Without a residual the new
    residual is x itself.
    """
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Rotate x ([T, heads, head_dim]) by position, NeoX / HF `rotate_half` pairing (i, i + d/2).

    cos_sin_cache: [max_position, head_dim] = cat(cos, sin) of position * inv_freq, in float32.
    """
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
