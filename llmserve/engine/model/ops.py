"""How a decoder layer's hot ops run, chosen once per model by `select_ops`:

- `ReferenceOps`: kernels/reference.py in plain torch. The CPU engine's path, and float32 on a
  GPU (the CUDA kernels are fp16 / bf16 only). Reads the step's metadata as Python lists, so it
  synchronizes and cannot be captured in a CUDA graph.
- `KernelOps`: kernels/cuda.py (store_kv, paged decode / varlen prefill attention, fused RMSNorm,
  rotary, SiLU-and-mul). Reads the step's metadata as int32 device tensors, made once per step by
  `prepare` (or given by a CUDA graph's static buffers), and never synchronizes.
- `StateKernelOps`: ReferenceOps, except the recurrent layers' decode rows through their CUDA
  kernel (gated DeltaNet: kernels/gated_delta.cu; Mamba-2: kernels/ssd_step.cu): a GPU model
  with such layers whose attention the kernels cannot run (Qwen3-Next's head_dim 256).

The layers call `ops.<op>(...)` and never ask which backend they have.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from llmserve.engine.config import ATTENTION_BACKENDS
from llmserve.engine.model.attention_context import AttentionContext
from llmserve.engine.model.decode_splits import DecodeSplits, padded_batch_size  # noqa: F401 (re-exported)
from llmserve.engine.step.sampler import to_device
from llmserve.kernels import gated_delta_reference as gdr
from llmserve.kernels import moe_reference as moe_ref
from llmserve.kernels import reference as ref
from llmserve.kernels.ssd_step_reference import ssd_update

NO_LIMIT = (0.0, float("inf"))  # Mamba-2's default time_step_limit: no clamp

if TYPE_CHECKING:
    from llmserve.common.model_config import ModelConfig
    from llmserve.engine.features.lora import LoraBatch


class LayerOps:
    """A backend of the layers' hot ops: the functions of `lib` (kernels/reference.py or
    kernels/cuda.py, which share their signatures), less what a subclass overrides."""

    name: str
    graph_safe: bool  # whether a forward through these ops can be captured in a CUDA graph
    lib: Any

    def prepare(self, ctx: AttentionContext) -> AttentionContext:
        """ctx as `attention` reads it (once per step)."""
        return ctx

    def fix_decode_splits(
        self, config: ModelConfig, max_model_len: int, batch_sizes: list[int]
    ) -> None:
        """Fix how decode steps split their contexts (see DecodeSplits); a no-op for ops
        without split-K."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lib.rms_norm(x, weight, eps, residual)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def latent_attention(
        self, q: Tensor, latent: Tensor, cache: Tensor, ctx: AttentionContext, scale: float,
        rank: int,
    ) -> Tensor:  # fmt: skip
        """Multi-head latent attention (engine/model/families/deepseek.py): store this step's
        latents [T, 1, rank + rope] in the one-head latent pool, then every query head (absorbed,
        [T, heads, rank + rope]) attends over them as key (whole) and value (the first `rank`
        values); [T, heads, rank]."""
        return self.attention(q, latent, latent, cache, cache, ctx, scale)[..., :rank]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.lib.silu_and_mul(x)

    def moe_experts(
        self,
        x: Tensor,
        weights: Tensor,
        ids: Tensor,
        w13: Tensor,
        w2: Tensor,
        first_expert: int,
        oss: moe_ref.ClampedSwiGLU | None = None,
    ) -> Tensor:
        """The routed experts' weighted sum per token (kernels/moe_reference.py); oss: gpt-oss's
        biases and clamped SwiGLU."""
        return moe_ref.moe_experts(x, weights, ids, w13, w2, first_expert, oss)

    def gated_delta_decode(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        slot_ids: Tensor,
    ) -> Tensor:  # fmt: skip
        """One token of B decode rows of a gated DeltaNet layer (engine/model/families/
        qwen3_next.py): q, k [B, H, dk] (l2-normalised here), v [B, H, dv], g (log decay) and
        beta [B, H] float32; state: the layer's recurrent pool [slots, H, dk, dv] float32, each
        row's slot (slot_ids) updated in place. Returns [B, H, dv]."""
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        return gdr.gated_delta_step(q, k, v, g.float(), beta.float(), state, slot_ids, out)

    def ssd_decode(
        self, x: Tensor, dt: Tensor, dt_bias: Tensor, a: Tensor, b: Tensor, c: Tensor,
        d: Tensor, state: Tensor, slot_ids: Tensor, limit: tuple[float, float] = NO_LIMIT,
    ) -> Tensor:  # fmt: skip
        """One token of B decode rows of a Mamba-2 layer (engine/model/mamba2.py), after its
        conv: x [B, H, P]; dt [B, H] raw (before dt_bias, softplus and the clamp to `limit`,
        the config's time_step_limit); dt_bias, a (= -exp(A_log)), d [H]; b, c [B, G, N];
        state: the layer's pool [slots, H, P, N] float32, each row's slot (slot_ids) updated
        in place. Returns y [B, H, P] (D x included, before the gated norm) in x's dtype, as
        kernels/ssd_step.cu writes it."""
        return _ssd_torch(x, dt, dt_bias, a, b, c, d, state, slot_ids, limit)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """kernels/reference.py's on every backend (no CUDA kernel of its own yet)."""
        return ref.gelu_tanh_and_mul(x)

    def lora_add(self, lora: LoraBatch, layer: int, group: str, x: Tensor, out: Tensor) -> None:
        """The step's adapter updates of projection `group` added into out
        (engine/features/lora.py),
        through torch's products (kernels/lora_reference.py)."""
        lora.add(layer, group, x, out)


class OpsModule(torch.nn.Module):
    """A module whose forward runs through `self.ops` (LlamaForCausalLM.set_ops swaps it)."""

    def __init__(self, ops: LayerOps):
        super().__init__()
        self.ops = ops


class ReferenceOps(LayerOps):
    """kernels/reference.py: exactly what the CPU engine has always run."""

    name = "torch"
    graph_safe = False
    lib = ref

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = ref.rotary_embedding(positions, q, cos_sin)
        return q, ref.rotary_embedding(positions, k, cos_sin)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend (reference.paged_attention)."""
        ref.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        return ref.paged_attention(
            q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q, scale,
            window=window, softcap=softcap, sinks=sinks, trees=ctx.tree_masks,
        )  # fmt: skip


@dataclass
class _CpuStep:
    """What CpuOps.prepare works out once per step for every layer's attention."""

    slots: torch.Tensor  # the KV slots written this step (padding rows left out)
    keep: torch.Tensor | None  # the rows of k / v that go to `slots` (None: all of them)
    decode_rows: list[int]  # requests with one query this step
    decode_tokens: torch.Tensor | None  # their query rows (None: every row, in order)
    decode_blocks: torch.Tensor  # their block tables, flattened, to the longest context
    decode_len: int  # the longest context, in whole blocks
    decode_mask: torch.Tensor  # [rows, 1, 1, decode_len]: True where a key is in context
    decode_lens: torch.Tensor  # [rows]: their context lengths

    def window_mask(self, window: int) -> torch.Tensor:
        """decode_mask less the keys before each row's last `window` positions."""
        k_pos = torch.arange(self.decode_len)[None, :]
        seen = k_pos > (self.decode_lens - 1 - window)[:, None]
        return self.decode_mask & seen[:, None, None, :]


class CpuOps(ReferenceOps):
    """The CPU engine's ops: kernels/reference.py's math, with the step's attention metadata
    made once per step (`prepare`) instead of in each layer, q and k rotated in one op, and a
    decode-only step attended to in one scaled_dot_product_attention call over all heads (GQA
    without copies) instead of two products per KV head. A step with prefill chunks goes to
    the reference as it is."""

    name = "torch-cpu"

    def prepare(self, ctx: AttentionContext) -> AttentionContext:
        slots = ctx.slot_mapping
        valid = slots >= 0
        keep = None if bool(valid.all()) else valid.nonzero().flatten()
        if keep is not None:
            slots = slots[keep]
        rows = [
            b
            for b in range(len(ctx.seq_lens))
            if ctx.cu_seqlens_q[b + 1] - ctx.cu_seqlens_q[b] == 1
        ]
        tokens = [ctx.cu_seqlens_q[b] for b in rows]
        block_size = ctx.kv_caches[0][0].shape[1] if ctx.kv_caches else 1
        lens = [ctx.seq_lens[b] for b in rows]
        blocks = -(-max(lens, default=0) // block_size)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        mask = torch.arange(blocks * block_size)[None, :] < lens_t[:, None]
        step = _CpuStep(
            slots,
            keep,
            rows,
            None if tokens == list(range(len(ctx.seq_lens))) else torch.tensor(tokens),
            ctx.block_tables[rows, :blocks].flatten(),
            blocks * block_size,
            mask[:, None, None, :],
            lens_t,
        )
        return dataclasses.replace(ctx, cpu_step=step)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        both = ref.rotary_embedding(positions, torch.cat((q, k), dim=1), cos_sin)
        return both[:, : q.shape[1]], both[:, q.shape[1] :]

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = ctx.cpu_step
        assert isinstance(step, _CpuStep), "prepare() first"
        if step.keep is not None:
            k, v = k[step.keep], v[step.keep]
        for cache, new in ((k_cache, k), (v_cache, v)):
            flat = cache.view(-1, *cache.shape[2:])
            ref._as_bytes(flat)[step.slots] = ref._as_bytes(ref.quantize_kv(new, flat.dtype))
        if len(step.decode_rows) == len(ctx.seq_lens) and softcap is None and sinks is None:
            return self._decode(q, k_cache, v_cache, step, scale, window)
        return ref.paged_attention(  # prefill chunks, soft-capped scores, sinks or trees
            q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q, scale,
            window=window, softcap=softcap, sinks=sinks, trees=ctx.tree_masks,
        )  # fmt: skip

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: _CpuStep,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """[rows, heads, head_dim]: each decode row's one query over its context (its last
        `window` positions with a sliding window)."""
        rows, heads, dim = len(step.decode_rows), q.shape[1], q.shape[2]
        kv = []
        for cache in (k_cache, v_cache):
            gathered = ref._as_bytes(cache).flatten(1).index_select(0, step.decode_blocks)
            shape = (rows, step.decode_len, *cache.shape[2:])  # [rows, L, kv_heads, dim]
            kv.append(gathered.view(cache.dtype).view(shape).to(q.dtype).transpose(1, 2))
        queries = q if step.decode_tokens is None else q[step.decode_tokens]
        attn = torch.nn.functional.scaled_dot_product_attention(
            queries.view(rows, heads, 1, dim),
            kv[0],
            kv[1],
            attn_mask=step.decode_mask if window is None else step.window_mask(window),
            scale=scale,
            enable_gqa=heads != k_cache.shape[2],
        )
        return attn.view(rows, heads, dim)


def _delta_kernel(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot_ids: Tensor
) -> Tensor:
    """LayerOps.gated_delta_decode through kernels/gated_delta.cu (graph-safe, no sync)."""
    import llmserve.kernels.cuda as kc

    q, k, v = (x.contiguous() for x in (q, k, v))
    g, beta = (x.float().contiguous() for x in (g, beta))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return kc.gated_delta_step(q, k, v, g, beta, state, slot_ids, out)


def _ssd_torch(
    x: Tensor, dt: Tensor, dt_bias: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor,
    state: Tensor, slot_ids: Tensor, limit: tuple[float, float],
) -> Tensor:  # fmt: skip
    """LayerOps.ssd_decode in torch (kernels/ssd_step_reference.py's ssd_update over all rows
    at once: their states gathered, updated, scattered back)."""
    step = torch.nn.functional.softplus(dt.float() + dt_bias.float()).clamp(*limit)
    y, new = ssd_update(x, step, a, b, c, d, state[slot_ids])
    state[slot_ids] = new
    return y.to(x.dtype)


def _ssd_kernel(
    x: Tensor, dt: Tensor, dt_bias: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor,
    state: Tensor, slot_ids: Tensor, limit: tuple[float, float],
) -> Tensor:  # fmt: skip
    """LayerOps.ssd_decode through kernels/ssd_step.cu (no sync). The kernel
    has no clamp: a time_step_limit other than (0, inf) runs `_ssd_torch` (select_ops says so
    at start, _clamp_note)."""
    import llmserve.kernels.cuda as kc

    if limit != NO_LIMIT:
        return _ssd_torch(x, dt, dt_bias, a, b, c, d, state, slot_ids, limit)
    x, b, c = (t.contiguous() for t in (x, b, c))
    dt, dt_bias, a, d = (t.float().contiguous() for t in (dt, dt_bias, a, d))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return kc.ssd_step(x, dt, dt_bias, a, b, c, d, state, slot_ids, out)


class StateKernelOps(ReferenceOps):
    """ReferenceOps with the recurrent layers' decode steps on their CUDA kernels (select_ops's
    fallback for a GPU model with gated DeltaNet or Mamba-2 layers, see the module); `name`
    says which kernel the model's layers use."""

    def __init__(self, name: str = "torch+gated_delta.cu") -> None:
        self.name = name

    def gated_delta_decode(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        slot_ids: Tensor,
    ) -> Tensor:  # fmt: skip
        return _delta_kernel(q, k, v, g, beta, state, slot_ids)

    def ssd_decode(
        self, x: Tensor, dt: Tensor, dt_bias: Tensor, a: Tensor, b: Tensor, c: Tensor,
        d: Tensor, state: Tensor, slot_ids: Tensor, limit: tuple[float, float] = NO_LIMIT,
    ) -> Tensor:  # fmt: skip
        return _ssd_kernel(x, dt, dt_bias, a, b, c, d, state, slot_ids, limit)


class KernelOps(LayerOps):
    """kernels/cuda.py. q and k are rotated in place (they are fresh views of the qkv product).
    With `splits` set (fix_decode_splits, by the engine), decode-only steps use its count."""

    name = "cuda"
    graph_safe = True

    def __init__(self) -> None:
        import llmserve.kernels.cuda as kc

        self.lib = kc
        self.splits: DecodeSplits | None = None

    def fix_decode_splits(
        self, config: ModelConfig, max_model_len: int, batch_sizes: list[int]
    ) -> None:
        """Decode steps split as DecodeSplits says for this (per-rank) model shape, capacity
        and graph batch sizes, on the current GPU."""
        if not torch.cuda.is_available():  # the CPU emulator's tests: no graphs to agree with
            return
        device = torch.device("cuda", torch.cuda.current_device())
        slots = self.lib.decode_slots(device, config.head_dim)
        self.splits = DecodeSplits(
            max_model_len, tuple(sorted(batch_sizes)), config.num_heads, config.num_kv_heads, slots
        )

    def moe_experts(
        self,
        x: Tensor,
        weights: Tensor,
        ids: Tensor,
        w13: Tensor,
        w2: Tensor,
        first_expert: int,
        oss: moe_ref.ClampedSwiGLU | None = None,
    ) -> Tensor:
        """kernels/moe.cu: no sort and no host synchronization (graph-safe)."""
        return self.lib.moe_experts(x, weights, ids, w13, w2, first_expert, oss)

    def lora_add(self, lora: LoraBatch, layer: int, group: str, x: Tensor, out: Tensor) -> None:
        """kernels/lora.cu on decode-like steps (gathered per row, graph-safe); a step with a
        long prefill segment through torch's per-segment matmuls (engine/features/lora.py)."""
        lora.add(layer, group, x, out, kernel=self.lib.lora_add)

    def prepare(self, ctx: AttentionContext) -> AttentionContext:
        """The step's int32 device metadata from its host lists, once per step; a context that
        already has it (a CUDA graph's static buffers) is returned as it is.

        seq_lens and cu_seqlens_q travel in one copy through pinned memory (it does not wait for
        the kernels already queued)."""
        if ctx.seq_lens_t is not None:
            return ctx
        num_seqs = len(ctx.seq_lens)
        meta = to_device([*ctx.seq_lens, *ctx.cu_seqlens_q], torch.int32, ctx.slot_mapping.device)
        max_seqlen_q = max(b - a for a, b in itertools.pairwise(ctx.cu_seqlens_q))
        return dataclasses.replace(
            ctx,
            block_tables=ctx.block_tables.to(torch.int32),
            seq_lens_t=meta[:num_seqs],
            cu_seqlens_q_t=meta[num_seqs:],
            max_seqlen_q=max_seqlen_q,
            max_seq_len=max(ctx.seq_lens),
            num_splits=self.decode_splits(num_seqs) if max_seqlen_q == 1 else None,
        )

    def decode_splits(self, num_seqs: int) -> int | None:
        """The split count of a decode-only step of num_seqs requests (None: without `splits`,
        the kernel's own choice from the batch's longest context)."""
        return None if self.splits is None else self.splits.count(num_seqs)

    def latent_attention(
        self, q: Tensor, latent: Tensor, cache: Tensor, ctx: AttentionContext, scale: float,
        rank: int,
    ) -> Tensor:  # fmt: skip
        """store_kv of the latents, then kernels/mla_decode.cu on a decode-only step (graph-safe);
        any other step (prefill chunks, token trees) through the torch reference on the pool."""
        assert ctx.seq_lens_t is not None, "prepare() first"
        self.lib.store_kv(latent, latent, cache, cache, ctx.slot_mapping)
        if ctx.max_seqlen_q == 1 and ctx.tree_masks is None:
            return self.lib.mla_decode_attention(
                q, cache, ctx.block_tables, ctx.seq_lens_t, rank, scale
            )
        return ref.paged_attention(
            q, cache, cache, ctx.block_tables.long(), ctx.seq_lens, ctx.cu_seqlens_q, scale,
            trees=ctx.tree_masks,
        )[..., :rank]  # fmt: skip

    def gated_delta_decode(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
        slot_ids: Tensor,
    ) -> Tensor:  # fmt: skip
        return _delta_kernel(q, k, v, g, beta, state, slot_ids)

    def ssd_decode(
        self, x: Tensor, dt: Tensor, dt_bias: Tensor, a: Tensor, b: Tensor, c: Tensor,
        d: Tensor, state: Tensor, slot_ids: Tensor, limit: tuple[float, float] = NO_LIMIT,
    ) -> Tensor:  # fmt: skip
        """kernels/ssd_step.cu (graph-safe, no sync)."""
        return _ssd_kernel(x, dt, dt_bias, a, b, c, d, state, slot_ids, limit)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.lib.rotary_embedding(positions, q, cos_sin, out=q)
        self.lib.rotary_embedding(positions, k, cos_sin, out=k)
        return q, k

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """store_kv, then the decode kernel (every request one query) or the varlen prefill
        kernel (anything else), as kernels.cuda.paged_attention dispatches. sinks (gpt-oss) go
        to the kernels in float32 (a no-op for a float32 parameter)."""
        assert ctx.seq_lens_t is not None and ctx.cu_seqlens_q_t is not None, "prepare() first"
        sinks = None if sinks is None else sinks.float()
        self.lib.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.tree_masks is not None and window is None:  # token trees: the tree mask
            return self.lib.paged_prefill_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens_t, ctx.cu_seqlens_q_t, scale,
                softcap=softcap, tree_bits=ctx.tree_bits, tree_start=ctx.tree_start, sinks=sinks,
            )  # fmt: skip
        if ctx.tree_masks is not None:  # and a sliding window: the kernel's compares storage
            return ref.paged_attention(
                q, k_cache, v_cache, ctx.block_tables.long(), ctx.seq_lens, ctx.cu_seqlens_q,
                scale, window=window, softcap=softcap, sinks=sinks, trees=ctx.tree_masks,
            )  # fmt: skip
        if ctx.num_splits is not None and ctx.max_seqlen_q == 1:
            return self.lib.paged_decode_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens_t, scale,
                num_splits=ctx.num_splits, window=window, softcap=softcap, sinks=sinks,
            )  # fmt: skip
        return self.lib.paged_attention(
            q,
            k_cache,
            v_cache,
            ctx.block_tables,
            ctx.seq_lens_t,
            ctx.cu_seqlens_q_t,
            scale,
            max_seqlen_q=ctx.max_seqlen_q,
            max_seq_len=ctx.max_seq_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


def kernel_limits(config: ModelConfig, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the CUDA kernels cannot run this model (None when they can), checked without a GPU."""
    from llmserve.kernels.cuda import HEAD_DIMS

    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {str(dtype).removeprefix('torch.')}: the CUDA kernels are fp16 / bf16 only"
    if config.mla is not None:
        rank, latent = config.mla.kv_lora_rank, config.mla.latent_dim
        if rank > 512 or rank % 8 or latent % 8:
            return (
                f"multi-head latent attention with kv_lora_rank={rank}, latent {latent}: "
                "kernels/mla_decode.cu needs kv_lora_rank <= 512, both multiples of 8"
            )
    elif config.head_dim not in HEAD_DIMS:
        return f"head_dim={config.head_dim}: the CUDA kernels support {HEAD_DIMS}"
    if config.rotary_dim % 16:
        return f"rotary dimension {config.rotary_dim}: the rotary kernel needs a multiple of 16"
    if config.hidden_size % 8 or config.hidden_size > 24576:
        return f"hidden_size={config.hidden_size}: rms_norm needs a multiple of 8, <= 24576"
    if config.intermediate_size % 8:
        return f"intermediate_size={config.intermediate_size}: silu_and_mul needs a multiple of 8"
    if config.moe is not None and config.moe.intermediate_size % 8:
        return f"moe_intermediate_size={config.moe.intermediate_size}: moe.cu needs a multiple of 8"
    return state_kernel_limits(config)


def state_kernel_limits(config: ModelConfig) -> str | None:
    """Why the recurrent layers' decode kernel (kernels/gated_delta.cu for gated DeltaNet,
    kernels/ssd_step.cu for Mamba-2) cannot run this model's layers (None: it can, or the model
    has none)."""
    from llmserve.kernels.gated_delta import GDN_MAX_DK
    from llmserve.kernels.ssd_step import MAX_GRID_Y

    delta, mamba = config.gated_delta_net, config.mamba2
    if delta is not None and delta.head_k_dim > GDN_MAX_DK:
        return f"linear_key_head_dim={delta.head_k_dim}: gated_delta.cu needs <= {GDN_MAX_DK}"
    if mamba is not None and mamba.num_heads > MAX_GRID_Y:
        return f"mamba_n_heads={mamba.num_heads}: ssd_step.cu needs <= {MAX_GRID_Y}"
    return None


def _clamp_note(config: ModelConfig) -> str:
    """What the start line adds for Mamba-2 layers whose dt is clamped (ssd_step.cu has no
    clamp: their decode rows stay on torch, `_ssd_kernel`)."""
    limit = NO_LIMIT if config.mamba2 is None else config.mamba2.time_step_limit
    return "" if limit == NO_LIMIT else f"; Mamba-2 decode in torch: time_step_limit={limit}"


def select_ops(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    config: ModelConfig,
    block_size: int,
) -> tuple[LayerOps, str]:
    """(ops, why). backend: "torch" = ReferenceOps (CpuOps on a CPU); "cuda" = KernelOps or a
    ValueError saying why not; "auto" = KernelOps on a GPU whenever they can run and pass
    `self_check`, else ReferenceOps (CpuOps on a CPU; StateKernelOps on a GPU for a model with
    gated DeltaNet or Mamba-2 layers whose decode kernel passes its self-check); why: the
    reason the kernels were not used, or what the recurrent layers got."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend == "torch":
        ops: LayerOps = CpuOps() if device.type == "cpu" else ReferenceOps()
        return ops, "asked for (--attention-backend torch)"
    if device.type != "cuda":
        if backend == "cuda":
            raise ValueError(f"--attention-backend cuda needs --device cuda, not {device.type}")
        return CpuOps(), f"device {device.type}"
    why_not = kernel_limits(config, dtype, block_size)
    if why_not is None:
        import llmserve.kernels.cuda as kc

        if not kc.is_available():
            why_not = "kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)"
    if why_not is None:
        ops = KernelOps()
        why_not = self_check(ops, config, dtype, device, block_size)
        if why_not is None:
            return ops, f"CUDA kernels (kernels/cuda.py), self-check passed{_clamp_note(config)}"
    if backend == "cuda":
        raise ValueError(f"--attention-backend cuda: {why_not}")
    return _torch_ops(config, dtype, device, block_size, f"fell back to torch: {why_not}")


def _torch_ops(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int, why: str
) -> tuple[LayerOps, str]:
    """select_ops's GPU fallback: StateKernelOps for a model with gated DeltaNet or Mamba-2
    layers whose decode kernel runs here (fp16 / bf16, CuPy, state_kernel_limits) and passes
    `self_check`, else ReferenceOps; why, extended with what those layers got."""
    if config.gated_delta_net is None and config.mamba2 is None:
        return ReferenceOps(), why
    import llmserve.kernels.cuda as kc

    delta = config.gated_delta_net is not None
    what, kernel = ("DeltaNet", "gated_delta.cu") if delta else ("Mamba-2", "ssd_step.cu")
    why_not = state_kernel_limits(config)
    if dtype not in (torch.float16, torch.bfloat16):
        why_not = f"dtype {str(dtype).removeprefix('torch.')}"
    elif why_not is None and not kc.is_available():
        why_not = "kernels.cuda.is_available() is False"
    ops = StateKernelOps(f"torch+{kernel}")
    if why_not is None:
        why_not = self_check(ops, config, dtype, device, block_size)
    if why_not is not None:
        return ReferenceOps(), f"{why}; the {what} layers through torch too: {why_not}"
    note = _clamp_note(config)
    return ops, f"{why}; the {what} layers' decode rows through kernels/{kernel}{note}"


def self_check(
    ops: LayerOps,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
) -> str | None:
    """Run ops on a small step of this model's shapes (a prefill chunk and a decode, paged)
    beside kernels/reference.py; why they disagree or fail (None: they agree). Catches a kernel
    that does not compile or misbehaves on this card, before any request does."""
    tolerance = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    try:
        for name, got, want in _check_cases(ops, config, dtype, device, block_size):
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance * max(1.0, want.float().abs().max().item()):
                return f"self-check: {name} differs from kernels/reference.py by {error:.3g}"
    except Exception as err:  # a kernel that fails to compile or launch on this card
        return f"self-check: {type(err).__name__}: {err}"
    return None


def _check_cases(
    ops: LayerOps, config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(op, ops' result, the reference's) on seeded inputs: two requests, 5 prompt tokens and
    1 decode token after 2 * block_size cached ones, over a shuffled pool."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    ref_ops = ReferenceOps()
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    x, w = rand(6, config.hidden_size), rand(config.hidden_size)
    yield "rms_norm", ops.rms_norm(x, w, 1e-6, None)[0], ref_ops.rms_norm(x, w, 1e-6, None)[0]
    gate_up = rand(6, 2 * config.intermediate_size)
    yield "silu_and_mul", ops.silu_and_mul(gate_up), ref_ops.silu_and_mul(gate_up)
    if config.moe is not None:  # experts 1 and 2 of 4 at the model's widths, top-2
        width = config.moe.intermediate_size
        w13 = rand(2, 2 * width, config.hidden_size) * 0.05
        w2 = rand(2, config.hidden_size, width) * 0.05
        route = moe_ref.route(torch.randn(6, 4, generator=gen).to(device), 2, True)
        swiglu = config.moe.clamped_swiglu  # gpt-oss: with its biases and activation
        oss = swiglu and moe_ref.ClampedSwiGLU(rand(2, 2 * width), rand(2, w.shape[0]), *swiglu)
        got, want = (o.moe_experts(x, *route, w13, w2, 1, oss or None) for o in (ops, ref_ops))
        yield "moe_experts", got, want
    if config.gated_delta_net is not None:
        yield from _delta_cases(ops, ref_ops, config, rand, gen, device)
    if config.mamba2 is not None:
        yield from _ssd_cases(ops, ref_ops, config, rand, gen, device)
    if config.mla is not None:
        yield from _latent_cases(ops, ref_ops, config, rand, device, block_size)
        return
    seq_lens, cu_seqlens_q = [5, 2 * block_size + 1], [0, 5, 6]
    num_blocks = 8
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([order[:4], order[4:]]).to(device)
    slots = [int(tables[0, p // block_size]) * block_size + p % block_size for p in range(5)]
    slots.append(int(tables[1, 2]) * block_size)  # the decode token: position 2 * block_size
    cache = rand(2, num_blocks, block_size, kv_heads, dim)
    q, k, v = rand(6, heads, dim), rand(6, kv_heads, dim), rand(6, kv_heads, dim)
    sinks = rand(heads).float() if config.attention_sinks else None  # gpt-oss
    outputs = []
    for backend in (ops, ref_ops):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        ctx = AttentionContext(
            torch.tensor(slots, device=device), tables, seq_lens, cu_seqlens_q, []
        )
        ctx = backend.prepare(ctx)
        outputs.append(backend.attention(q, k, v, k_cache, v_cache, ctx, dim**-0.5, sinks=sinks))
    yield "attention", outputs[0], outputs[1]


def _delta_cases(
    ops: LayerOps,
    ref_ops: LayerOps,
    config: ModelConfig,
    rand: Callable[..., Tensor],
    gen: torch.Generator,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """gated_delta_decode beside the reference at the model's DeltaNet widths: 3 rows in slots
    2, 0, 3 of 4; the outputs and the updated pool."""
    assert config.gated_delta_net is not None
    d = config.gated_delta_net
    heads, dk, dv = d.num_v_heads, d.head_k_dim, d.head_v_dim
    q, k, v = rand(3, heads, dk), rand(3, heads, dk), rand(3, heads, dv)
    g = -torch.rand(3, heads, generator=gen).to(device)
    beta = torch.rand(3, heads, generator=gen).to(device)
    pool = (torch.randn(4, heads, dk, dv, generator=gen) * 0.1).to(device)
    slot_ids = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    states = [pool.clone(), pool.clone()]
    got = ops.gated_delta_decode(q, k, v, g, beta, states[0], slot_ids)
    want = ref_ops.gated_delta_decode(q, k, v, g, beta, states[1], slot_ids)
    yield "gated_delta_decode", got, want
    yield "gated_delta_decode (state)", states[0], states[1]


def _ssd_cases(
    ops: LayerOps,
    ref_ops: LayerOps,
    config: ModelConfig,
    rand: Callable[..., Tensor],
    gen: torch.Generator,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """ssd_decode beside the reference at the model's Mamba-2 widths: 3 rows in slots 2, 0, 3
    of 4 (dt both sides of softplus's threshold 20); y and the updated pool."""
    assert config.mamba2 is not None
    m = config.mamba2
    heads, dim, n = m.num_heads, m.head_dim, m.state_size
    x, b, c = rand(3, heads, dim), rand(3, m.num_groups, n), rand(3, m.num_groups, n)
    dt = torch.randn(3, heads, generator=gen).to(device)
    dt[0, 0] = 25.0
    dt_bias, d = (torch.randn(heads, generator=gen).to(device) for _ in range(2))
    a = -torch.rand(heads, generator=gen).to(device)
    pool = (torch.randn(4, heads, dim, n, generator=gen) * 0.1).to(device)
    slot_ids = torch.tensor([2, 0, 3], dtype=torch.int64, device=device)
    states = [pool.clone(), pool.clone()]
    got = ops.ssd_decode(x, dt, dt_bias, a, b, c, d, states[0], slot_ids)
    want = ref_ops.ssd_decode(x, dt, dt_bias, a, b, c, d, states[1], slot_ids)
    yield "ssd_decode", got, want
    yield "ssd_decode (state)", states[0], states[1]


def _latent_cases(
    ops: LayerOps,
    ref_ops: LayerOps,
    config: ModelConfig,
    rand: Callable[..., Tensor],
    device: torch.device,
    block_size: int,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """MLA's latent_attention beside the reference: a step of 5 prompt tokens and 1 decode token
    after 2 * block_size cached ones, then a decode-only step (the MLA kernel's) of that request,
    over a shuffled latent pool."""
    assert config.mla is not None
    rank, dim, heads = config.mla.kv_lora_rank, config.mla.latent_dim, config.num_heads
    order = torch.randperm(8)
    tables = torch.stack([order[:4], order[4:]]).to(device)
    slots = [int(tables[0, p // block_size]) * block_size + p % block_size for p in range(5)]
    slots.append(int(tables[1, 2]) * block_size)  # the decode token: position 2 * block_size
    pool = rand(8, block_size, 1, dim)
    q, latent = rand(6, heads, dim), rand(6, 1, dim)
    long = 2 * block_size + 1
    steps = [
        ("mixed", slots, tables, [5, long], [0, 5, 6], q, latent),
        ("decode", slots[5:], tables[1:], [long], [0, 1], q[5:], latent[5:]),
    ]
    for name, step_slots, step_tables, seq_lens, cu, step_q, step_latent in steps:
        outputs = []
        for backend in (ops, ref_ops):
            cache = pool.clone()
            slot_t = torch.tensor(step_slots, device=device)
            ctx = backend.prepare(AttentionContext(slot_t, step_tables, seq_lens, cu, []))
            outputs.append(backend.latent_attention(step_q, step_latent, cache, ctx, 0.1, rank))
        yield f"latent_attention ({name})", outputs[0], outputs[1]
