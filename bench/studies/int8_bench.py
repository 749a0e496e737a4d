"""The weight-only int8 linear (kernels/int8_gemm.cu) on the Llama-3-8B linear shapes, against
the same product in bf16 through torch (cuBLAS) and through torch's own int8 kernel
(`torch._weight_int8pack_mm`, what --quantization int8 ran on a GPU before).

For each shape (N x K: q/o 4096 x 4096, qkv 6144 x 4096, gate_up 28672 x 4096, down 4096 x 14336)
and batch (rows of x: 1, 4, 16, 64): the median time per call (tools of kernels_bench.py: CUDA
events around replays of a CUDA graph of back-to-back calls, after warm-up), the bytes moved
(weights + scales + x + y) per second, and that as a percentage of the 4.28 TB/s device copy
(docs/gpu.md#the-gpu-machine). Every call reads a different copy of the weights, so that the working
set (>= 256 MB) is far beyond the 50 MB L2 and the weights come from HBM, as in a forward pass.
Targets (issue 24): >= 75% of copy bandwidth at batch 1 on 4096 x 4096 and 4096 x 14336.

Run through bench/gpu/kernels_bench.py (`--only int8` for this section alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from llmserve.kernels import int8 as ki
from llmserve.kernels import reference as ref

SHAPES: dict[str, tuple[int, int]] = {
    "q/o": (4096, 4096),
    "qkv": (6144, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
BATCHES = (1, 4, 16, 64)
WORKING_SET_BYTES = 256 * 2**20
TARGET_PCT = 75.0
TimeFn = Callable[[Callable[[], Any]], dict[str, Any]]


def _rate(timing: dict[str, Any], num_bytes: int, copy_tbps: float) -> dict[str, Any]:
    seconds = timing["ms"] / 1e3
    gbps = num_bytes / seconds / 1e9
    return {
        **timing,
        "us": timing["ms"] * 1e3,
        "gbps": gbps,
        "pct_of_copy": 100 * gbps / (copy_tbps * 1e3),
    }


def bench_shape(
    name: str, batch: int, time_ms: TimeFn, copy_tbps: float, device: torch.device
) -> dict[str, Any]:
    """One shape and batch: ours, bf16 through torch, torch's int8 kernel; and ours' error
    against the float32 reference."""
    n, k = SHAPES[name]
    copies = max(1, math.ceil(WORKING_SET_BYTES / (n * k)))
    q, scales = ref.quantize_int8_per_channel(torch.randn(n, k, device=device) * 0.02)
    packed = [ki.pack_weight(q)] + [torch.empty_like(q) for _ in range(copies - 1)]
    for w in packed[1:]:
        w.copy_(packed[0])
    x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(batch, n, device=device, dtype=torch.bfloat16)
    want = ref.int8_linear(x.float(), q, scales)
    got = ki.int8_linear(x, packed[0], scales).float()
    error = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "batch": batch, "copies": copies}
    row["rel_error_vs_fp32"] = error
    io_bytes = batch * k * 2 + batch * n * 2

    def ours() -> None:
        for w in packed:
            ki.int8_linear(x, w, scales, out=out)

    timing = time_ms(ours)
    timing["ms"] /= copies
    row["int8"] = _rate(timing, n * k + 4 * n + io_bytes, copy_tbps)
    packed.clear()  # free the int8 copies before the bf16 ones
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]

    def bf16() -> None:
        for w in weights:
            torch.matmul(x, w.t(), out=out)

    timing = time_ms(bf16)
    timing["ms"] /= copies
    row["bf16"] = _rate(timing, 2 * n * k + io_bytes, copy_tbps)
    row["speedup_vs_bf16"] = row["bf16"]["ms"] / row["int8"]["ms"]
    row["gbps"], row["pct_of_copy"] = row["int8"]["gbps"], row["int8"]["pct_of_copy"]  # ours
    weights.clear()
    row["torch_int8pack"] = _torch_int8pack(q, x, copies, time_ms, copy_tbps, io_bytes)
    return row


def _torch_int8pack(
    q: torch.Tensor, x: torch.Tensor, copies: int, time_ms: TimeFn, copy_tbps: float, io: int
) -> dict[str, Any]:
    n, k = q.shape
    scales = torch.rand(n, device=q.device, dtype=x.dtype)
    weights = [q.clone() for _ in range(copies)]

    def run() -> None:
        for w in weights:
            torch._weight_int8pack_mm(x, w, scales)

    try:
        timing = time_ms(run)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    timing["ms"] /= copies
    return _rate(timing, n * k + 2 * n + io, copy_tbps)


def run_all(
    time_ms: TimeFn, copy_tbps: float, device: torch.device, attempt: Callable, quick: bool
) -> list[dict[str, Any]]:
    batches = (1, 16) if quick else BATCHES
    rows = []
    for name in SHAPES:
        for batch in batches:
            row = attempt(partial(bench_shape, name, batch, time_ms, copy_tbps, device))
            row.update({"shape": name, "batch": batch})
            rows.append(row)
            torch.cuda.empty_cache()
            print(f"int8 {name} B={batch}: {row.get('int8', row)}"[:160], flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """A short table: per shape and batch, ours and bf16 in us, GB/s and % of copy."""
    lines = [
        "int8 linear (kernels/int8_gemm.cu) vs bf16 torch, 8B shapes",
        f"{'shape':>8} {'B':>3} | {'int8 us':>8} {'GB/s':>6} {'%copy':>5} | {'bf16 us':>8} "
        f"{'%copy':>5} | {'x bf16':>6} | {'torch int8 us':>13}",
    ]
    verdicts = []
    for r in rows:
        o, b, t = r.get("int8", {}), r.get("bf16", {}), r.get("torch_int8pack", {})
        if not o:
            lines.append(f"{r['shape']:>8} {r['batch']:>3} | {r.get('error', r)}"[:100])
            continue
        lines.append(
            f"{r['shape']:>8} {r['batch']:>3} | {o['us']:8.1f} {o['gbps']:6.0f} "
            f"{o['pct_of_copy']:5.0f} | {b.get('us', math.nan):8.1f} "
            f"{b.get('pct_of_copy', math.nan):5.0f} | {r.get('speedup_vs_bf16', math.nan):6.2f} | "
            f"{t.get('us', math.nan):13.1f}"
        )
        if r["batch"] == 1 and r["shape"] in ("q/o", "down"):
            verdicts.append(o["pct_of_copy"] >= TARGET_PCT)
    verdict = "yes" if verdicts and all(verdicts) else ("no" if verdicts else "unmeasured")
    lines.append(f"  int8 batch 1 >= {TARGET_PCT:.0f}% of copy (q/o, down): {verdict}")
    return lines
