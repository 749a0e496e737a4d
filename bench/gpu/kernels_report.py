"""The short table bench/gpu/kernels_bench.py prints last (and stores as "summary" in its JSON):
each section's figures beside the ceilings of docs/gpu.md#the-gpu-machine and the targets, with
verdicts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.studies import int8_bench

COPY_TBPS = 4.28  # docs/gpu.md#the-gpu-machine, device-to-device copy, bytes read + written


def fmt(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def summary(results: dict[str, Any]) -> str:
    lines = [f"GPU: {results['device']}  copy ceiling used {COPY_TBPS} TB/s "
             f"(measured here {fmt(results['copy_ceiling'].get('tbps'), '.2f')})"]  # fmt: skip
    lines.append("decode   B   ctx   ms     TB/s  %copy  splits | flash ms  eff ms  ours/best")
    dec_ok_large: list[float | None] = []
    dec_ok_small: list[float | None] = []
    dec_vs_torch: list[float | None] = []
    for r in results["decode"]:
        o = r.get("ours", {})
        best_ms = o.get("ms")
        splits = r.get("auto_splits")
        for s, sr in (r.get("sweep") or {}).items():
            if "ms" in sr and (best_ms is None or sr["ms"] < best_ms):
                best_ms, splits = sr["ms"], f"{s}*"
        tf = r.get("torch_flash", {}).get("ms")
        te = r.get("torch_efficient", {}).get("ms")
        torch_best = min([t for t in (tf, te) if t is not None], default=None)
        pct = 100 * r["kv_bytes"] / best_ms / 1e9 / COPY_TBPS if best_ms else None
        ratio = best_ms / torch_best if best_ms and torch_best else None
        (dec_ok_small if r["batch"] <= 4 else dec_ok_large).append(pct)
        dec_vs_torch.append(ratio)
        lines.append(
            f"       {r['batch']:4d} {r['context']:5d} {fmt(best_ms, '.4f'):>7} "
            f"{fmt(pct and pct * COPY_TBPS / 100, '.2f'):>5} {fmt(pct, '.0f'):>5}  "
            f"{splits!s:>6} | {fmt(tf, '.4f'):>8} {fmt(te, '.4f'):>7}  {fmt(ratio, '.2f'):>6}"
        )
    lines.append(
        "prefill  seqs new   ctx  | bm64 TFLOP/s  bm128 TFLOP/s | flash TFLOP/s  best/flash"
    )
    pre_ratio = []
    for r in results["prefill"]:
        t64 = r.get("ours_block_m64", {}).get("tflops")
        t128 = r.get("ours_block_m128", {}).get("tflops")
        tfl = r.get("torch_flash", {}).get("tflops")
        best = max([t for t in (t64, t128) if t is not None], default=None)
        ratio = best / tfl if best and tfl else None
        if r["context"] == 0:
            pre_ratio.append(ratio)
        lines.append(
            f"         {r['seqs']:4d} {r['new_tokens']:4d} {r['context']:5d} | "
            f"{fmt(t64, '.0f'):>12}  {fmt(t128, '.0f'):>13} | {fmt(tfl, '.0f'):>13}  "
            f"{fmt(ratio, '.2f'):>9}"
        )
    if results.get("decode_fp8"):
        lines.append("decode fp8 B  ctx   ms     TB/s  %copy | bf16 pool ms  fp8/bf16")
    bf16_ms = {(r["batch"], r["context"]): r.get("ours", {}).get("ms") for r in results["decode"]}
    for r in results.get("decode_fp8", []):
        ms = r.get("ours", {}).get("ms")
        base = bf16_ms.get((r["batch"], r["context"]))
        lines.append(
            f"       {r['batch']:4d} {r['context']:5d} {fmt(ms, '.4f'):>7} "
            f"{fmt(r.get('ours', {}).get('tbps'), '.2f'):>5} "
            f"{fmt(r.get('ours', {}).get('pct_copy'), '.0f'):>5} | {fmt(base, '.4f'):>12}  "
            f"{fmt(ms / base if ms and base else None, '.2f'):>8}"
        )
    kv_pct = []
    for r in results["store_kv"]:
        o = r.get("ours", {})
        copy_tbps = r.get("torch_copy_same_bytes", {}).get("tbps")
        kv_pct.append(o.get("pct_copy"))
        lines.append(
            f"store_kv tokens {r.get('tokens')}: {fmt(o.get('ms'), '.4f')} ms "
            f"{fmt(o.get('tbps'), '.2f')} TB/s = {fmt(o.get('pct_copy'), '.0f')}% of copy "
            f"(torch copy of the same bytes {fmt(copy_tbps, '.2f')} TB/s)"
        )
    for name, r in (results.get("layer_ops") or {}).items():
        if isinstance(r, dict) and "ours" in r:
            lines.append(
                f"{name}: {fmt(r['ours']['ms'], '.4f')} ms ({fmt(r['tbps'], '.2f')} TB/s), "
                f"{fmt(r['speedup'], '.1f')}x the torch reference"
            )

    def verdict(values: list[Any], test: Callable[[float], bool]) -> str:
        if not values or any(v is None for v in values):
            return "INCOMPLETE"
        return (
            "MET"
            if all(test(v) for v in values)
            else f"NOT MET (worst {fmt(min(values) if test(1e9) else max(values), '.2f')})"
        )

    lines.append("targets (issue 3):")
    lines.append(
        f"  decode B64-256 x 1k-8k >= 80% of copy: {verdict(dec_ok_large, lambda p: p >= 80)}"
    )
    lines.append(
        f"  decode B1-4 x 32k >= 60% of copy:      {verdict(dec_ok_small, lambda p: p >= 60)}"
    )
    lines.append(
        f"  decode no slower than torch (ratio<=1): {verdict(dec_vs_torch, lambda r: r <= 1.0)}"
    )
    lines.append(
        f"  prefill 4k >= 0.8x torch flash:         {verdict(pre_ratio, lambda r: r >= 0.8)}"
    )
    lines.append(f"  store_kv >= 70% of copy:                {verdict(kv_pct, lambda p: p >= 70)}")
    if results.get("int8_linear"):
        lines += int8_bench.summary(results["int8_linear"])
    return "\n".join(lines)
