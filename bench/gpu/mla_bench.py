"""The `families` section of bench/gpu/kernels_bench.py: kernels/mla_decode.cu (multi-head
latent attention decode over the latent pool) on DeepSeek-V2-Lite's attention shape (16 query
heads, kv_lora_rank 512, qk_rope_head_dim 64: one latent of 576 values per token, bf16, blocks
of 16), in latent bytes read / time against the device copy ceiling, and against the same
absorbed attention in torch (two batched matmuls and a softmax over a contiguous latent, no
gather timed). A relative-error spot check against kernels/reference.py on one sequence."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import llmserve.kernels.cuda as kc
from bench.gpu.kernels_report import COPY_TBPS
from bench.gpu.timing import attempt, free, time_ms
from llmserve.kernels import reference as ref

SHAPE = {"model": "DeepSeek-V2-Lite", "num_heads": 16, "kv_lora_rank": 512, "rope_dim": 64}
RANK, ROPE, HEADS, BLOCK_SIZE = 512, 64, 16, 16
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda", 0)
SHAPES = [(1, 4096), (16, 4096), (64, 4096), (64, 16384)]
QUICK_SHAPES = [(1, 4096), (64, 4096)]


def latent_pool(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent pool [blocks, 16, 1, 576] whose sequences own shuffled blocks; int32
    block tables."""
    per_seq = -(-context // BLOCK_SIZE)
    pool = torch.randn(batch * per_seq, BLOCK_SIZE, 1, RANK + ROPE, dtype=DTYPE, device=DEVICE)
    perm = torch.randperm(batch * per_seq, device=DEVICE, dtype=torch.int32)
    return pool, perm.view(batch, per_seq)


def bench_mla_decode(batch: int, context: int) -> dict[str, Any]:
    pool, tables = latent_pool(batch, context)
    q = torch.randn(batch, HEADS, RANK + ROPE, dtype=DTYPE, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    out = torch.empty(batch, HEADS, RANK, dtype=DTYPE, device=DEVICE)
    scale = (128 + ROPE) ** -0.5  # DeepSeek's softmax scale: qk_nope 128 + rope 64
    latent_bytes = batch * context * (RANK + ROPE) * pool.element_size()

    def call() -> None:
        kc.mla_decode_attention(q, pool, tables, lens, RANK, scale, out=out)

    row: dict[str, Any] = {"batch": batch, "context": context, "latent_bytes": latent_bytes}
    r = time_ms(call)
    r["tbps"] = latent_bytes / r["ms"] / 1e9
    r["pct_copy"] = 100 * r["tbps"] / COPY_TBPS
    row["ours"] = r
    expect = ref.mla_decode_attention(q[:1].float(), pool, tables[:1], [context], RANK, scale)
    row["check_rel_err"] = float((out[:1].float() - expect).norm() / expect.norm())
    latent = pool[tables.long()].flatten(1, 3)[:, :context].contiguous()  # [B, L, 576]

    def torch_absorbed() -> None:
        probs = torch.softmax(torch.bmm(q, latent.transpose(1, 2)).float() * scale, dim=-1)
        torch.bmm(probs.to(DTYPE), latent[..., :RANK])

    t = attempt(lambda: time_ms(torch_absorbed))
    if "ms" in t:
        t["tbps"] = latent_bytes / t["ms"] / 1e9
        row["ours_over_torch"] = r["ms"] / t["ms"]
    row["torch_matmul"] = t
    return row


def run_all(run: Callable[[Callable[[], dict[str, Any]]], dict[str, Any]], quick: bool) -> dict:
    """{"shape": SHAPE, "mla_decode": [rows]}, each row through kernels_bench's `run` (which
    skips it once the time budget is spent)."""
    rows = []
    for b, c in QUICK_SHAPES if quick else SHAPES:
        row = run(partial(bench_mla_decode, b, c))
        free()
        row.update({"batch": b, "context": c})
        rows.append(row)
        print(f"mla decode B={b} ctx={c}: {row.get('ours', row)}"[:160], flush=True)
    return {"shape": SHAPE, "mla_decode": rows}


def summary(families: dict[str, Any]) -> str:
    """One line per MLA decode shape: ms, TB/s of latent read, % of the copy ceiling, against
    torch's absorbed matmuls, the spot check's relative error."""

    def fmt(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"mla decode ({SHAPE['model']}: 16 heads, 512 + 64 latent, bf16)  B  ctx   ms  "
             "TB/s %copy ours/torch rel_err"]  # fmt: skip
    for r in families.get("mla_decode", []):
        o = r.get("ours", {})
        lines.append(
            f"  {r['batch']:4d} {r['context']:6d} {fmt(o.get('ms'), '.4f'):>8} "
            f"{fmt(o.get('tbps'), '.2f'):>5} {fmt(o.get('pct_copy'), '.0f'):>4} "
            f"{fmt(r.get('ours_over_torch'), '.2f'):>6} {fmt(r.get('check_rel_err'), '.1e'):>8}"
            + ("" if "ours" in r else f"  {str(r)[:80]}")
        )
    return "\n".join(lines)
