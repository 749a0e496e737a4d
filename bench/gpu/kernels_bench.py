"""Time kernels/cuda.py on the GPU against the ceilings measured there (docs/gpu.md#the-gpu-machine:
4.28 TB/s device copy, 780 TFLOP/s bf16 matmul) and against torch on the same data laid out
contiguously.

Measures (Llama-3-8B attention shape: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16):
  - decode attention, batch 64-256 x contexts 1k-8k and batch 1-4 x 32k: KV bytes read / time,
    against torch scaled_dot_product_attention (flash / efficient) on contiguous K/V (no gather
    timed); for batch 1-4 also a sweep of the split count;
  - the same decode shapes over an FP8 (e4m3) KV pool with k_scale / v_scale: FP8 bytes read /
    time, and time against the bf16 pool's (ideally about half: half the bytes);
  - prefill attention on 4k-token causal chunks (no context, and after 4k of context) against
    torch's flash SDPA, in TFLOP/s of causal attention actually needed;
  - store_kv against a plain device copy of the same bytes;
  - rms_norm (+ residual), rotary embedding and silu_and_mul against kernels/reference.py;
  - families: MLA decode over the latent pool on DeepSeek-V2-Lite's shape (bench/gpu/mla_bench.py);
  - the weight-only int8 linear on the 8B linear shapes at batch 1-64 against bf16 through torch
    (bench/studies/int8_bench.py; `--only int8` runs that section alone);
  - the W4A16 and FP8-block linears (quantized checkpoints, issue 41) on the 8B projections at
    batch 1 and 8 against bf16 (bench/gpu/quant_gemm_bench.py: q/o only in the full run, every
    shape with `--only quant`).
Each figure is the median of several replays of a CUDA graph holding back-to-back calls (so
Python launch overhead is not timed); working sets exceed the 50 MB L2 wherever bandwidth is
claimed. Prints a short table last and writes everything to --out as JSON.

    python3 -m bench.gpu.kernels_bench [--out bench/results/kernels_h200.json] [--quick]
        [--only fp8|int8|mla|quant]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import llmserve.kernels.cuda as kc
from bench.gpu import mla_bench, quant_gemm_bench
from bench.gpu.kernels_report import COPY_TBPS, summary
from bench.gpu.timing import attempt, free, time_ms
from bench.studies import int8_bench
from llmserve.kernels import reference as ref

ROOT = Path(__file__).resolve().parents[2]

MATMUL_TFLOPS = 780.0  # docs/gpu.md#the-gpu-machine, bf16 8192^3 through torch
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------
# Data


def paged_pool(
    seq_lens: list[int], num_kv_heads: int = NUM_KV_HEADS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V pools whose sequences own shuffled blocks; int32 block tables."""
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(need)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    v = torch.randn(shape, dtype=DTYPE, device=DEVICE)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    tables = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32, device=DEVICE)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    return k, v, tables


def contiguous_kv(
    k: torch.Tensor, tables: torch.Tensor, seq_len: int
) -> torch.Tensor:  # [B, Hkv, L, D]
    return k[tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# Decode


def torch_sdpa(
    q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Any, **mask: Any
) -> dict[str, Any]:
    """torch's SDPA on `backend` over contiguous K/V [B, Hkv, L, D] with GQA, timed; with K/V
    expanded to every query head (more bytes, same FLOPs) if torch refuses enable_gqa. mask:
    is_causal or attn_mask, as SDPA takes them."""
    from torch.nn.attention import sdpa_kernel

    def timed(k: torch.Tensor, v: torch.Tensor, **gqa: Any) -> dict[str, Any]:
        def call() -> None:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q4, k, v, **mask, **gqa)

        return attempt(lambda: time_ms(call))

    result = timed(k, v, enable_gqa=True)
    result["gqa"] = "enable_gqa"
    if "error" in result:
        group = q4.shape[1] // k.shape[1]
        result = timed(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        result["gqa"] = "expanded K/V (torch refused enable_gqa)"
    return result


def bench_decode(batch: int, context: int, sweep: bool) -> dict[str, Any]:
    seq_lens = [context] * batch
    k, v, tables = paged_pool(seq_lens)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k.element_size()

    def ours(splits: int | None) -> dict[str, Any]:
        def call() -> None:
            kc.paged_decode_attention(
                q, k, v, tables, lens, scale, max_seq_len=context, num_splits=splits, out=out
            )

        r = time_ms(call)
        r["tbps"] = kv_bytes / r["ms"] / 1e9
        r["pct_copy"] = 100 * r["tbps"] / COPY_TBPS
        return r

    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    slots = torch.cuda.get_device_properties(DEVICE).multi_processor_count * 3
    row["auto_splits"] = kc.decode_num_splits(batch * NUM_KV_HEADS, context, slots)
    row["ours"] = attempt(lambda: ours(None))
    if sweep:
        row["sweep"] = {s: attempt(partial(ours, s)) for s in (1, 8, 16, 24, 32, 48, 64, 96)}
    # correctness spot check against the reference on this data (one sequence)
    expect = ref.paged_attention(
        q[:1].float(), k, v, tables[:1].long(), [context], [0, 1], scale
    )  # the reference gathers this sequence's rows and upcasts them
    row["check_rel_err"] = float((out[:1].float() - expect.float()).norm() / expect.float().norm())
    del expect
    kk, vv = contiguous_kv(k, tables, context), contiguous_kv(v, tables, context)
    k = v = None  # type: ignore[assignment]  # drop the pool before the contiguous copies are timed
    free()
    from torch.nn.attention import SDPBackend

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
        r = attempt(partial(torch_sdpa, q.unsqueeze(2), kk, vv, backend))
        if "ms" in r:
            r["tbps"] = kv_bytes / r["ms"] / 1e9
        row[f"torch_{name}"] = r
    del kk, vv
    free()
    return row


def bench_decode_fp8(batch: int, context: int) -> dict[str, Any]:
    """bench_decode's shape over an FP8 pool (K / k_scale, V / v_scale stored), auto splits."""
    seq_lens = [context] * batch
    k, v, tables = paged_pool(seq_lens)
    k_scale, v_scale = 4.5 / 448, 4.5 / 448  # standard normal K / V: +-4.5 fills E4M3's range
    k8, v8 = torch.empty_like(k, dtype=FP8), torch.empty_like(v, dtype=FP8)
    for i in range(0, k.shape[0], 4096):  # in slices: quantize_kv's float64 temporaries are 8x
        k8[i : i + 4096] = ref.quantize_kv(k[i : i + 4096], FP8, k_scale)
        v8[i : i + 4096] = ref.quantize_kv(v[i : i + 4096], FP8, v_scale)
    del k, v
    free()
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM  # one byte per element

    def call() -> None:
        kc.paged_decode_attention(
            q, k8, v8, tables, lens, scale, k_scale, v_scale, max_seq_len=context, out=out
        )

    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    r = attempt(lambda: time_ms(call))
    if "ms" in r:
        r["tbps"] = kv_bytes / r["ms"] / 1e9
        r["pct_copy"] = 100 * r["tbps"] / COPY_TBPS
    row["ours"] = r

    def check() -> dict[str, Any]:  # the reference gathers one sequence's FP8 rows, upcasts them
        expect = ref.paged_attention(
            q[:1].float(), k8, v8, tables[:1].long(), [context], [0, 1], scale, k_scale, v_scale
        )
        return {"rel_err": float((out[:1].float() - expect).norm() / expect.norm())}

    row["check"] = attempt(check)
    k8 = v8 = None  # type: ignore[assignment]
    free()
    return row


# ---------------------------------------------------------------------------------------------
# Prefill


def causal_flops(num_new: int, context: int, num_seqs: int) -> float:
    """QK^T and PV over the keys each query actually sees: 4 * D * H * sum(context + i + 1)."""
    pairs = num_new * context + num_new * (num_new + 1) / 2
    return 4.0 * HEAD_DIM * NUM_HEADS * pairs * num_seqs


def bench_prefill(num_seqs: int, num_new: int, context: int) -> dict[str, Any]:
    seq_len = num_new + context
    k, v, tables = paged_pool([seq_len] * num_seqs)
    q = torch.randn(num_seqs * num_new, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * num_new
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    flops = causal_flops(num_new, context, num_seqs)
    row: dict[str, Any] = {"seqs": num_seqs, "new_tokens": num_new, "context": context}
    for block_m in kc.PREFILL_CONFIGS:

        def call(block_m: int = block_m) -> None:
            kc.paged_prefill_attention(q, k, v, tables, lens, cu, scale, block_m=block_m, out=out)

        r = attempt(partial(time_ms, call))
        if "ms" in r:
            r["tflops"] = flops / r["ms"] / 1e9
        row[f"ours_block_m{block_m}"] = r
    kk = contiguous_kv(k, tables, seq_len)
    vv = contiguous_kv(v, tables, seq_len)
    k = v = None  # type: ignore[assignment]  # drop the pool before the contiguous copies are timed
    free()
    q4 = q.view(num_seqs, num_new, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    causal = (
        {"is_causal": True} if context == 0 else {"attn_mask": causal_lower_right(num_new, seq_len)}
    )
    r = torch_sdpa(q4, kk, vv, SDPBackend.FLASH_ATTENTION, **causal)
    if "ms" in r:
        r["tflops"] = flops / r["ms"] / 1e9
    row["torch_flash"] = r
    del kk, vv
    free()
    return row


# ---------------------------------------------------------------------------------------------
# store_kv and layer ops


def bench_store_kv(num_tokens: int) -> dict[str, Any]:
    kv_width = NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, NUM_HEADS * HEAD_DIM + 2 * kv_width, dtype=DTYPE, device=DEVICE)
    key = qkv[:, NUM_HEADS * HEAD_DIM : -kv_width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, -kv_width:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    num_blocks = 2 * num_tokens // BLOCK_SIZE
    k = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.zeros_like(k)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    moved = 2 * 2 * num_tokens * kv_width * 2  # K and V, read + written, 2 bytes each
    r = time_ms(lambda: kc.store_kv(key, value, k, v, slots))
    r["tbps"] = moved / r["ms"] / 1e9
    r["pct_copy"] = 100 * r["tbps"] / COPY_TBPS
    src = torch.randn(2 * num_tokens * kv_width, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    c = time_ms(lambda: dst.copy_(src))
    c["tbps"] = moved / c["ms"] / 1e9
    r_ref = time_ms(lambda: ref.store_kv(key, value, k, v, slots), graph=False)  # it syncs
    return {"tokens": num_tokens, "bytes": moved, "ours": r, "torch_copy_same_bytes": c,
            "reference": r_ref}  # fmt: skip


def bench_copy_ceiling() -> dict[str, Any]:
    src = torch.empty(2**30, dtype=torch.float32, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    r = time_ms(lambda: dst.copy_(src), target_ms=10, replays=5)
    r["tbps"] = 2 * src.numel() * 4 / r["ms"] / 1e9
    src = dst = None  # type: ignore[assignment]
    free()
    return r


def bench_layer_ops(num_tokens: int = 8192) -> dict[str, Any]:
    hidden, inter = 4096, 14336
    x = torch.randn(num_tokens, hidden, dtype=DTYPE, device=DEVICE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=DTYPE, device=DEVICE)
    rows: dict[str, Any] = {}
    rows["rms_norm_residual"] = {
        "ours": time_ms(lambda: kc.rms_norm(x, w, 1e-5, res)),
        "reference": time_ms(lambda: ref.rms_norm(x, w, 1e-5, res)),
        "bytes": 4 * x.numel() * 2,
    }
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE,
                      device=DEVICE)  # fmt: skip
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(num_tokens, NUM_HEADS, HEAD_DIM)
    pos = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    rows["rotary_q"] = {
        "ours": time_ms(lambda: kc.rotary_embedding(pos, q, cache)),
        "reference": time_ms(lambda: ref.rotary_embedding(pos, q, cache)),
        "bytes": 2 * q.numel() * 2,
    }
    gu = torch.randn(num_tokens, 2 * inter, dtype=DTYPE, device=DEVICE)
    rows["silu_and_mul"] = {
        "ours": time_ms(lambda: kc.silu_and_mul(gu)),
        "reference": time_ms(lambda: ref.silu_and_mul(gu)),
        "bytes": 3 * num_tokens * inter * 2,
    }
    for r in rows.values():
        r["tbps"] = r["bytes"] / r["ours"]["ms"] / 1e9
        r["speedup"] = r["reference"]["ms"] / r["ours"]["ms"]
    return rows


def kernel_attributes() -> dict[str, Any]:
    """Registers, local memory and shared memory limit of the attention kernels of this shape
    and of the int8 linear's."""
    import cupy  # type: ignore[import-not-found, unused-ignore]

    ctype = "bf16_t"
    specs = [kc.decode_spec(ctype, HEAD_DIM), kc.prefill_spec(ctype, HEAD_DIM)]
    specs += [kc.decode_spec(ctype, HEAD_DIM, kc.FP8_CTYPE), kc.int8_gemm_spec(ctype)]
    attrs: dict[str, Any] = {}
    index = DEVICE.index or 0
    with cupy.cuda.Device(index):
        for spec in specs:
            for expr in spec.name_expressions:

                def read(spec: kc.ModuleSpec = spec, expr: str = expr) -> dict[str, Any]:
                    kernel = kc._kernel(spec, expr, index)
                    return {
                        "num_regs": kernel.num_regs,
                        "local_size_bytes": kernel.local_size_bytes,
                        "max_dynamic_shared_size_bytes": kernel.max_dynamic_shared_size_bytes,
                    }

                attrs[f"{spec.filename}:{expr}"] = attempt(read)
    return attrs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels_h200.json"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    parser.add_argument(
        "--budget-s", type=float, default=600.0, help="skip the shapes left after this many seconds"
    )
    parser.add_argument(
        "--only",
        choices=("fp8", "int8", "mla", "quant"),
        help="fp8: only decode over bf16 and FP8 pools (the FP8 comparison, a few minutes less); "
        "int8: only the int8 linear against bf16; mla: only the families section; quant: only "
        "the W4A16 and FP8-block linears against bf16",
    )
    args = parser.parse_args()
    if not kc.is_available():
        print("kernels.cuda is not available here (needs CuPy and a CUDA GPU of sm_80+)")
        return 2
    torch.manual_seed(0)
    t0 = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(DEVICE)
    results: dict[str, Any] = {
        "device": props.name,
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ceilings": {"copy_tbps": COPY_TBPS, "bf16_matmul_tflops": MATMUL_TFLOPS},
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE),
        },
        "decode": [],
        "decode_fp8": [],
        "prefill": [],
        "store_kv": [],
    }
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        results["cupy"] = cupy.__version__
    except ImportError:
        pass

    def save() -> None:  # after every section, so a run cut short still leaves its numbers
        results["seconds"] = time.time() - t0
        out.write_text(json.dumps(results, indent=1, default=str))

    def run(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if time.time() - t0 > args.budget_s:
            return {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
        return attempt(fn)

    results["copy_ceiling"] = run(bench_copy_ceiling)
    # families (MLA decode, bench/gpu/mla_bench.py) first: a few seconds, inside any budget
    results["families"] = mla_bench.run_all(run, args.quick or args.budget_s < 120)
    save()
    if args.only == "mla":
        print(f"\nwrote {out}\n\n{mla_bench.summary(results['families'])}")
        return 0
    if args.only == "int8":
        results["int8_linear"] = int8_bench.run_all(time_ms, COPY_TBPS, DEVICE, run, args.quick)
        results["summary"] = "\n".join(int8_bench.summary(results["int8_linear"]))
        save()
        print(f"\nwrote {out}\n\n{results['summary']}")
        return 0
    if args.only == "quant":
        results["quant_linear"] = quant_gemm_bench.run_all(
            time_ms, COPY_TBPS, DEVICE, run, args.quick
        )
        results["summary"] = "\n".join(quant_gemm_bench.summary(results["quant_linear"]))
        save()
        print(f"\nwrote {out}\n\n{results['summary']}")
        return 0
    large = [(b, c) for b in (64, 128, 256) for c in (1024, 2048, 4096, 8192)]
    small = [(b, 32768) for b in (1, 2, 4)]
    if args.quick:
        large, small = [(64, 1024), (256, 4096)], [(1, 32768)]
    for b, c in small + large:
        row = run(partial(bench_decode, b, c, sweep=b <= 4))
        row.update({"batch": b, "context": c, "kv_bytes": 2 * b * c * NUM_KV_HEADS * HEAD_DIM * 2})
        results["decode"].append(row)
        print(f"decode B={b} ctx={c}: {row.get('ours', row)}"[:160], flush=True)
        save()
    if args.only != "fp8":  # the FP8 pool comes last: the sections above keep the time budget
        for seqs, new, ctx in [(1, 4096, 0), (4, 4096, 0), (1, 4096, 4096)]:
            row = run(partial(bench_prefill, seqs, new, ctx))
            row.update({"seqs": seqs, "new_tokens": new, "context": ctx})
            results["prefill"].append(row)
            print(
                f"prefill {seqs}x{new}+{ctx}: {row.get('ours_block_m128', row)}"[:160], flush=True
            )
            save()
        for n in (4096, 32768):
            results["store_kv"].append(run(partial(bench_store_kv, n)))
        results["layer_ops"] = run(bench_layer_ops)
        results["int8_linear"] = int8_bench.run_all(time_ms, COPY_TBPS, DEVICE, run, args.quick)
        results["quant_linear"] = quant_gemm_bench.run_all(time_ms, COPY_TBPS, DEVICE, run, True)
        save()
    for b, c in small + large:
        row = run(partial(bench_decode_fp8, b, c))
        row.update({"batch": b, "context": c, "kv_bytes": 2 * b * c * NUM_KV_HEADS * HEAD_DIM})
        results["decode_fp8"].append(row)
        print(f"decode fp8 B={b} ctx={c}: {row.get('ours', row)}"[:160], flush=True)
        save()
    results["kernels"] = attempt(kernel_attributes)
    results["summary"] = summary(results) + "\n" + mla_bench.summary(results["families"])
    if results.get("quant_linear"):
        results["summary"] += "\n" + "\n".join(quant_gemm_bench.summary(results["quant_linear"]))
    save()
    print(f"\nwrote {out} ({results['seconds']:.0f} s)\n")
    print(results["summary"])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
