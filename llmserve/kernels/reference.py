"""The ground truth for every kernel, in plain torch. This is also what the CPU engine runs.

KV pool (one layer's half): `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`; token slot `s` lives at block `s // block_size`, row `s % block_size`. A step's query
tokens are flattened, request after request:

    cu_seqlens_q:  0        q0          q0+q1              T
                   |<- r0 ->|<-   r1   ->|<- ... ->|
    request b:     |<------ context (already in the pool) ------>|<- this step's q_b tokens ->|
                   0                                seq_len_b - q_b                 seq_len_b

Query i of request b sits at position `seq_len_b - q_b + i` and sees keys 0..that position.
An FP8 pool stores x / scale, saturated to +-448 (`k_scale`, `v_scale`; 1.0 for 16- and 32-bit
pools): kernels/README.md#fp8-kv-pool-format-and-scales, where the whole layout is too.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales must be finite and positive, and other than 1.0 only for an FP8 cache."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"{name}={value} must be a finite positive number")
        if value != 1.0 and cache_dtype != FP8_DTYPE:
            raise ValueError(
                f"{name}={value} applies only to a float8_e4m3fn cache; a "
                f"{str(cache_dtype).removeprefix('torch.')} cache stores values as they are "
                "(scale 1.0)"
            )


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale rounded to `dtype`; for FP8, saturated to +-448 (NaN stays NaN).

    The division is float32's correctly rounded x / float32(scale) (computed in float64, which
    rounds to the same float32), then one rounding to FP8, as the CUDA store kernel does."""
    if scale != 1.0:
        x = (x.double() / float(np.float32(scale))).float()
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes (uint8), other tensors as they are: FP8 rows move as bytes, so no
    gather / scatter kernel needs to support FP8 itself."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write rows `key[t]`, `value[t]` ([T, num_kv_heads, head_dim]) to slot `slot_mapping[t]`,
    as `quantize_kv(key, k_cache.dtype, k_scale)` (the same for value).

    Slot -1 marks a padding row and is skipped. Modifies k_cache and v_cache in place.
    """
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    _as_bytes(flat_k)[slot_mapping] = _as_bytes(quantize_kv(key, flat_k.dtype, k_scale))
    _as_bytes(flat_v)[slot_mapping] = _as_bytes(quantize_kv(value, flat_v.dtype, v_scale))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` token rows of one request, `[seq_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    rows = _as_bytes(cache).flatten(1).index_select(0, block_table[:num_blocks])
    return rows.view(cache.dtype).view(-1, *cache.shape[2:])[:seq_len]  # [blocks * bs, Hkv, D]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    trees: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole context in the paged pool.

    q: [T, num_heads, head_dim]; block_tables: [B, max_blocks_per_seq] (rows padded with any valid
    block id); seq_lens[b]: context length including this step's tokens; cu_seqlens_q: B+1 offsets
    into q. The step's own K/V must already be stored (store_kv) before the call. Returns
    [T, num_heads, head_dim] in q's dtype. GQA when num_heads is a multiple of num_kv_heads.

    The cache may have another dtype than q (FP8 with k_scale / v_scale, see the module
    docstring): only the rows gathered for a request are upcast to q's dtype, and the scales are
    applied as softmax(q . k * scale * k_scale) @ v * v_scale, which equals attention over
    k * k_scale and v * v_scale without a pass over the rows.

    window: a sliding window (Mistral, Gemma): the query at position p sees keys p - window + 1
    .. p only. softcap: scores (q . k * scale) become softcap * tanh(scores / softcap) before
    the mask and softmax (Gemma 2). sinks [num_heads]: gpt-oss's (_softmax_with_sinks). Decode
    rows (one query) are batched together; each longer chunk runs on its own. trees[b], where
    not None: request b's (mask [num_q, seq_len], key positions [seq_len]) in place of the
    causal mask and the positions 0..seq_len-1 (speculation's token trees,
    engine/features/token_tree.py).
    """
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    out = torch.empty_like(q)
    scale = scale * k_scale
    num_seqs = len(seq_lens)
    decode = [b for b in range(num_seqs) if cu_seqlens_q[b + 1] - cu_seqlens_q[b] == 1]
    if decode:
        _decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, decode, scale, v_scale, out,
            window, softcap, sinks,
        )  # fmt: skip
    for b in range(num_seqs):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        num_q = end - start
        if num_q <= 1:
            continue
        seq_len = seq_lens[b]
        k = gather_kv(k_cache, block_tables[b], seq_len).transpose(0, 1).unsqueeze(0)
        v = gather_kv(v_cache, block_tables[b], seq_len).transpose(0, 1).unsqueeze(0)
        qb = q[start:end].transpose(0, 1).unsqueeze(0)
        mask = _chunk_mask(seq_len, num_q, window, trees[b] if trees else None, q.device)
        attn = _chunk_attention(qb, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap, sinks)
        if v_scale != 1.0:
            attn = attn * v_scale
        out[start:end] = attn[0].transpose(0, 1)
    return out


def _chunk_mask(
    seq_len: int,
    num_q: int,
    window: int | None,
    tree: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
) -> torch.Tensor:
    """[num_q, seq_len]: the keys each of a request's last num_q queries sees (causal, or its
    token tree's mask), within the sliding window by position."""
    if tree is None:
        k_pos = torch.arange(seq_len, device=device)
        mask = k_pos[None, :] <= k_pos[seq_len - num_q :, None]
    else:
        mask, k_pos = tree[0].clone(), tree[1]
    if window is not None:
        mask &= k_pos[None, :] > k_pos[seq_len - num_q :, None] - window
    return mask


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
    rows: list[int],
    scale: float,
    v_scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
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
    k = _as_bytes(k_cache).flatten(1).index_select(0, index)  # [B * blocks, bs * Hkv * D]
    v = _as_bytes(v_cache).flatten(1).index_select(0, index)
    k = k.view(k_cache.dtype).view(shape).to(q.dtype)  # [B, L, Hkv, D]
    v = v.view(v_cache.dtype).view(shape).to(q.dtype)
    token_idx = torch.tensor([cu_seqlens_q[b] for b in rows], device=device)
    qg = q[token_idx].view(num_rows, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    k_pos = torch.arange(shape[1], device=device)[None, :]
    hidden = k_pos >= lens[:, None]
    if window is not None:  # the query sits at lens - 1
        hidden |= k_pos <= lens[:, None] - 1 - window
    hidden = hidden[:, None, :]
    accumulate = torch.promote_types(q.dtype, torch.float32)  # fp32 for half types, else q's
    attn = torch.empty_like(qg)
    for h in range(num_kv_heads):
        scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) * scale  # [B, G, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores.to(accumulate), dim=-1).to(q.dtype)
        else:
            group = sinks[h * qg.shape[2] : (h + 1) * qg.shape[2]]
            probs = _softmax_with_sinks(scores.to(accumulate), group[None, :]).to(q.dtype)
        attn[:, h] = torch.bmm(probs, v[:, :, h])
    if v_scale != 1.0:
        attn *= v_scale
    out[token_idx] = attn.view(num_rows, -1, head_dim)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's chunk of queries: q [1, H, Tq, D], k and v [1, Hkv, Tk, D], mask [Tq, Tk]
    True where a key is seen. Soft-capped scores, and sinks, are written out (SDPA has
    neither), the softmax in float32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_with_sinks(scores, sinks[None, :, None])
    return torch.matmul(probs.to(q.dtype), v)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of scores with one more logit, `sinks` (broadcast to
    scores' shape less that dimension), in the denominator only: a learned logit per head that
    attends to nothing, p_t = e^(s_t) / (sum e^(s) + e^sink), as transformers' gpt-oss computes
    it (the row's max subtracted first)."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1]).unsqueeze(-1)
    combined = torch.cat((scores, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gate: x = [gate | up] along the last dim -> gelu(gate, tanh approximation) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q [N, K], float32 scales [N]): symmetric, one scale per output channel (row),
    weight ~= q * scales[:, None], |q| <= 127 (the largest |weight| of a row maps to 127)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 x @ W^T: (x.float() @ q.float()^T) * scales, rounded once to x's dtype.

    x: [M, K]; qweight: int8 [N, K] in plain row order (kernels/int8.py packs it for the GPU);
    scales: float32 [N]. Returns [M, N] in x's dtype (float32 products and sums)."""
    out = (x.float() @ qweight.float().t()) * scales.float()[None, :]
    return out.to(x.dtype)


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed multi-head latent attention for one query token per sequence (kernels/
    mla_decode.cu's reference; engine/model/families/deepseek.py's decode step).

    q: [num_seqs, num_heads, kv_lora_rank + rope_dim], already absorbed (q_nope W_UK, q_rope);
    latent_cache: [num_blocks, block_size, 1, kv_lora_rank + rope_dim], one latent per token used
    as the key whole and as the value through its first kv_lora_rank values. In float32:
    softmax(scale * q . L) @ L[:, :kv_lora_rank], returned as [num_seqs, num_heads, kv_lora_rank]
    in q's dtype (zeros for a sequence of length 0)."""
    num_seqs, num_heads, _ = q.shape
    out = torch.zeros(num_seqs, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    for b, seq_len in enumerate(seq_lens):
        if seq_len <= 0:
            continue
        latent = gather_kv(latent_cache, block_tables[b], seq_len)[:, 0].float()  # [S, D]
        probs = torch.softmax(q[b].float() @ latent.t() * scale, dim=-1)  # [H, S]
        out[b] = (probs @ latent[:, :kv_lora_rank]).to(q.dtype)
    return out
