"""The quantized checkpoints' GPU linears (issue 41): kernels/w4a16_gemm.cu (W4A16, group 128)
and kernels/fp8_block_gemm.cu (FP8, 128 x 128 block scales) on the Llama-3-8B projections
against the same product in bf16 through torch (cuBLAS).

For each shape (N x K: q/o 4096 x 4096, gate/up 14336 x 4096, down 4096 x 14336) and batch (rows
of x: 1 and 8, decode): the median time per call (bench/gpu/timing.py: CUDA events around
replays of a CUDA graph of back-to-back calls), the bytes read (weights + scales + x + y) per
second and that as a percentage of the 4.28 TB/s device copy; each call reads another copy of the
weights (working set >= 256 MB, beyond the 50 MB L2: the weights come from HBM, as in a forward
pass). Arms: bf16 torch.matmul; W4A16 through the GEMV (auto) and through dequantize + cuBLAS;
FP8 through the GEMV, through dequantize + cuBLAS and, on sm_90, torch._scaled_mm's blockwise
path. Each arm's relative L2 error against the float32 product is recorded.

Run through bench/gpu/kernels_bench.py (`--only quant` for this section alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from llmserve.kernels import fp8_block, w4a16
from llmserve.kernels import quant_reference as qref

SHAPES: dict[str, tuple[int, int]] = {
    "q/o": (4096, 4096),
    "gate/up": (14336, 4096),
    "down": (4096, 14336),
}
BATCHES = (1, 8)
GROUP = 128
WORKING_SET_BYTES = 256 * 2**20
TimeFn = Callable[[Callable[[], Any]], dict[str, Any]]


def random_w4a16(n: int, k: int, device: torch.device) -> w4a16.W4A16Weight:
    """Random levels in every nibble, scales of a 0.02-wide weight, zero point 8."""
    words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
    scales = torch.rand(n, k // GROUP, device=device) * 2e-3 + 1e-3
    return w4a16.W4A16Weight(words, scales, -8 * scales, GROUP)


def random_fp8_block(n: int, k: int, device: torch.device) -> fp8_block.Fp8BlockWeight:
    """Random e4m3 values of a 0.02-wide weight, one scale per 128 x 128 block."""
    blocks = torch.rand(-(-n // 128), k // 128, device=device) * 1e-4 + 5e-5
    q = (torch.randn(n, k, device=device) * 200).clamp(-448, 448).to(torch.float8_e4m3fn)
    return fp8_block.pack_fp8_block(q, blocks.repeat_interleave(128, dim=0)[:n], GROUP)


def _rate(timing: dict[str, Any], num_bytes: int, copy_tbps: float, copies: int) -> dict[str, Any]:
    ms = timing["ms"] / copies
    gbps = num_bytes / (ms / 1e3) / 1e9
    return {**timing, "ms": ms, "us": ms * 1e3, "gbps": gbps, "pct_of_copy": gbps / copy_tbps / 10}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).norm(dim=1) / want.norm(dim=1)).max())


def _reference(
    weight: w4a16.W4A16Weight | fp8_block.Fp8BlockWeight, x: torch.Tensor
) -> torch.Tensor:
    """The float64 product on the CPU (random_w4a16's zero point is 8: offsets = -8 * scales)."""
    if isinstance(weight, w4a16.W4A16Weight):
        scales = weight.scales.cpu()
        levels = w4a16.unpack_levels(weight).cpu()
        return qref.w4a16_linear_reference(x, levels, scales, torch.full_like(scales, 8.0), GROUP)
    q = weight.q.view(torch.float8_e4m3fn).cpu()
    return qref.fp8_block_linear_reference(x, q, weight.scales.cpu(), GROUP)


def _arm(
    call: Callable[[Any], Any], weights: list[Any], nbytes: int, time_ms: TimeFn, tbps: float
) -> dict[str, Any]:
    def run() -> None:
        for w in weights:
            call(w)

    return _rate(time_ms(run), nbytes, tbps, len(weights))


def bench_shape(
    name: str, batch: int, time_ms: TimeFn, copy_tbps: float, device: torch.device
) -> dict[str, Any]:
    n, k = SHAPES[name]
    x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
    io = 2 * batch * (n + k)
    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "batch": batch}
    copies = max(1, math.ceil(WORKING_SET_BYTES / (n * k * 2)))
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    row["bf16"] = _arm(lambda w: x @ w.t(), dense, 2 * n * k + io, time_ms, copy_tbps)
    dense.clear()
    for fmt, make, linear in (
        ("w4a16", random_w4a16, w4a16.w4a16_linear),
        ("fp8_block", random_fp8_block, fp8_block.fp8_block_linear),
    ):
        first = make(n, k, device)
        copies = max(1, math.ceil(WORKING_SET_BYTES / first.nbytes))
        weights = [first] + [make(n, k, device) for _ in range(copies - 1)]
        want = _reference(first, x.cpu())
        paths = ["auto", "dequant"]
        if isinstance(first, fp8_block.Fp8BlockWeight) and not fp8_block.scaled_mm_unsupported(
            first, device
        ):
            paths.append("scaled_mm")
        for path in paths:
            arm: Callable[[Any], torch.Tensor] = partial(linear, x, path=path)
            key = f"{fmt}_{'gemv' if path == 'auto' else path}"
            row[key] = _arm(arm, weights, first.nbytes + io, time_ms, copy_tbps)
            row[key]["rel_error_vs_fp32"] = _error(arm(first).cpu(), want)
            row[key]["speedup_vs_bf16"] = row["bf16"]["ms"] / row[key]["ms"]
        weights.clear()
        torch.cuda.empty_cache()
    return row


def run_all(
    time_ms: TimeFn, copy_tbps: float, device: torch.device, attempt: Callable, quick: bool
) -> list[dict[str, Any]]:
    rows = []
    for name in SHAPES if not quick else ("q/o",):
        for batch in BATCHES:
            row = attempt(partial(bench_shape, name, batch, time_ms, copy_tbps, device))
            row.update({"shape": name, "batch": batch})
            rows.append(row)
            torch.cuda.empty_cache()
            print(f"quant {name} B={batch}: {row.get('w4a16_gemv', row)}"[:160], flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per shape and batch: us of bf16 and each arm, and the GEMVs' % of copy."""
    arms = ("w4a16_gemv", "w4a16_dequant", "fp8_block_gemv", "fp8_block_dequant",
            "fp8_block_scaled_mm")  # fmt: skip
    lines = [
        "W4A16 / FP8-block linears vs bf16 torch, 8B shapes (us; GEMV % of copy)",
        f"{'shape':>8} {'B':>2} | {'bf16':>7} | " + " ".join(f"{a:>19}" for a in arms),
    ]
    for r in rows:
        if "bf16" not in r:
            lines.append(f"{r['shape']:>8} {r['batch']:>2} | {r.get('error', r)}"[:100])
            continue
        cells = []
        for a in arms:
            arm = r.get(a, {})
            pct = f" ({arm['pct_of_copy']:.0f}%)" if a.endswith("gemv") and arm else ""
            cells.append(f"{arm.get('us', math.nan):.1f}{pct}".rjust(19))
        lines.append(
            f"{r['shape']:>8} {r['batch']:>2} | {r['bf16']['us']:7.1f} | " + " ".join(cells)
        )
    return lines
