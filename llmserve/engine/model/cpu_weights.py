"""--quantization auto's CPU weight path for a model on GGUF blocks: which form of its decoder
layers' weights a step multiplies.

    rows < dense_rows   the GGUF blocks (kernels/cpu_gguf.cpp): memory-bound, and a Q4_1
                        weight reads 0.625 bytes where float32 reads 4
    rows >= dense_rows  a dense copy prepacked for oneDNN's GEMM: compute-bound

The copy is made only within --cpu-dense-weights-mib; dense_rows is measured at start (or fixed
by --cpu-dense-rows), the LM head with its own crossover. `WeightPath` is the choice and its
reason, and counts the steps each form ran. See
docs/quantization.md#the-dense-copy---quantization-auto-issue-42.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve.engine.model.gguf_linear import GGUFLinear
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.kernels import cpu_features, cpu_gguf

MIB = 1 << 20
# Rows tried when measuring the crossover, and the repetitions whose fastest counts (the minimum
# is the figure least moved by other processes on a shared machine).
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROBE_REPEATS = 5
PROBE_LAYERS = 4  # the layers measured (SmolLM2's gate_up: 4 x 7 MB in float32, past its L3)
HEAD_PROBE_ROWS = 4096  # the LM head's crossover is measured on this many of its outputs


@dataclass
class WeightPath:
    """The form each step's decoder-layer products use, and why."""

    dense_rows: int  # from this many rows a step takes the dense copy; 0: never
    dtype: str  # the dense copy's ("float32" / "bfloat16"), "" without one
    dense_mib: float  # its size
    budget_mib: int
    reason: str
    head_rows: int = 0  # from this many rows the LM head takes its dense copy; 0: never
    steps: dict[str, int] = field(default_factory=lambda: {"packed": 0, "dense": 0})

    @property
    def name(self) -> str:
        return f"gguf+dense-{self.dtype}" if self.dense_rows else "gguf"

    def count(self, num_rows: int) -> bool:
        """Count one step of `num_rows` rows; whether it takes the dense copy."""
        dense = bool(self.dense_rows) and num_rows >= self.dense_rows
        self.steps["dense" if dense else "packed"] += 1
        return dense

    def figures(self) -> dict[str, object]:
        """For the engine's start line."""
        return {
            "cpu_weights": self.name,
            "cpu_dense_rows": self.dense_rows,
            "cpu_dense_head_rows": self.head_rows,
            "cpu_dense_mib": round(self.dense_mib, 1),
            "cpu_dense_budget_mib": self.budget_mib,
            "cpu_weights_reason": self.reason,
            "cpu_features": cpu_features.describe(),
        }


def dense_layers(model: LlamaForCausalLM) -> list[GGUFLinear]:
    """The decoder layers' projections on GGUF blocks through the kernel."""
    return [
        m
        for layer in model.layers
        for m in layer.modules()
        if isinstance(m, GGUFLinear) and m.dense is None
    ]


def dense_head(model: LlamaForCausalLM) -> GGUFLinear | None:
    """The LM head, where it is on GGUF blocks through the kernel (tied: the embeddings')."""
    head = model.lm_head
    return head if isinstance(head, GGUFLinear) and head.dense is None else None


def pack_dense(layer: GGUFLinear, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight widened from its blocks, in `dtype`, prepacked for oneDNN."""
    weight = cpu_gguf.dequantize(layer.blocks, layer.ggml_type).to(dtype)
    return cpu_gguf.pack_dense(weight)


def _fastest_ms(run: Callable[[], object]) -> float:
    run()
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(
    layers: list[GGUFLinear], dtypes: list[torch.dtype], rows_too: bool = True
) -> tuple[int, torch.dtype, str]:
    """(crossover rows, dtype, what was measured) on `layers` (weights of one shape, several of
    them so that the dense copies do not all stay in cache, as a step's 30 layers do not): the
    fastest dense dtype at the largest probe, then the fewest rows from which the dense GEMM
    beats the blocks there and at the next probe too (one win can be another process's pause);
    0: never."""
    packed = {d: [pack_dense(layer, d) for layer in layers] for d in dtypes}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS[-1], layers[0].in_features, generator=gen)

    def dense(xr: torch.Tensor, dtype: torch.dtype) -> None:
        for weight in packed[dtype]:
            cpu_gguf.dense_linear(xr, weight)

    def blocks(xr: torch.Tensor) -> None:
        for layer in layers:
            cpu_gguf.gguf_linear(xr, layer.blocks, layer.ggml_type)

    timed = {d: _fastest_ms(functools.partial(dense, x, d)) for d in dtypes}
    dtype = min(timed, key=lambda d: timed[d])
    if not rows_too:
        return 0, dtype, ""
    wins = []
    for rows in PROBE_ROWS:
        xr = x[:rows].contiguous()
        blocks_ms, dense_ms = (
            _fastest_ms(functools.partial(blocks, xr)),
            _fastest_ms(functools.partial(dense, xr, dtype)),
        )
        wins.append((rows, dense_ms < blocks_ms, f"{dense_ms:.2f} ms against {blocks_ms:.2f}"))
        if len(wins) >= 2 and wins[-2][1] and wins[-1][1]:
            rows, _, times = wins[-2]
            name = str(dtype).removeprefix("torch.")
            return rows, dtype, f"measured at start: at {rows} rows {name} {times} ms on blocks"
    return 0, dtype, f"measured at start: the blocks were as fast up to {PROBE_ROWS[-1]} rows"


def plan_weight_path(model: LlamaForCausalLM, budget_mib: int, dense_rows: int) -> WeightPath:
    """Choose, and where it is worth it make, the dense copy of `model`'s GGUF decoder layers
    (each GGUFLinear's `fast`, from `dense_rows` rows on; 0: the crossover measured here) and,
    where it also fits `budget_mib`, of its LM head; the choice is `model.weight_path`."""
    path = _plan(model, budget_mib, dense_rows)
    model.weight_path = path
    return path


def _plan(model: LlamaForCausalLM, budget_mib: int, dense_rows: int) -> WeightPath:
    layers = dense_layers(model)
    numel = sum(layer.blocks.shape[0] * layer.in_features for layer in layers)
    dtypes = cpu_features.gemm_dtypes()
    smallest = numel * min(torch.empty(0, dtype=d).element_size() for d in dtypes) / MIB
    if not layers or cpu_gguf.unavailable() is not None:
        return WeightPath(0, "", 0.0, budget_mib, "no decoder layer on GGUF blocks")
    if budget_mib == 0:
        why = "no dense copy: --cpu-dense-weights-mib=0, or --quantization gguf asked for"
        return WeightPath(0, "", 0.0, budget_mib, why)
    if smallest > budget_mib:
        why = f"a dense copy ({smallest:.0f} MiB) exceeds --cpu-dense-weights-mib={budget_mib}"
        return WeightPath(0, "", 0.0, budget_mib, why)
    if not torch.backends.mkldnn.is_available():
        return WeightPath(0, "", 0.0, budget_mib, "torch was built without oneDNN")
    largest = max(layers, key=lambda m: m.blocks.shape[0] * m.in_features)
    alike = [m for m in layers if m.blocks.shape == largest.blocks.shape]
    probes = alike[:: max(1, len(alike) // PROBE_LAYERS)][:PROBE_LAYERS]
    if dense_rows:  # the rows given: only the dtype is measured (none where float32 is alone)
        dtype = measure(probes[:1], dtypes, rows_too=False)[1] if len(dtypes) > 1 else dtypes[0]
        rows, reason = dense_rows, f"--cpu-dense-rows={dense_rows}"
    else:
        rows, dtype, reason = measure(probes, dtypes)
    size = numel * torch.empty(0, dtype=dtype).element_size() / MIB
    if size > budget_mib:  # bfloat16 measured slower than float32 and float32 does not fit
        rows, reason = 0, f"float32 copy ({size:.0f} MiB) exceeds the budget; {reason}"
    name = str(dtype).removeprefix("torch.") if rows else ""
    path = WeightPath(rows, name, 0.0, budget_mib, reason)
    if rows:
        for layer in layers:
            layer.fast = pack_dense(layer, dtype)
            layer.fast_rows = rows
        path.dense_mib = size
        _dense_head(path, dense_head(model), dtype, dense_rows)
    return path


def _dense_head(
    path: WeightPath, head: GGUFLinear | None, dtype: torch.dtype, dense_rows: int
) -> None:
    """The LM head's dense copy too, where it fits what the layers' left of the budget, from
    the rows measured on a slice of it (its blocks may be of another type: SmolLM2's Q8_0)."""
    if head is None:
        return
    size = head.blocks.shape[0] * head.in_features * torch.empty(0, dtype=dtype).element_size()
    if path.dense_mib + size / MIB > path.budget_mib:
        path.reason += f"; the LM head's copy ({size / MIB:.0f} MiB) exceeds the rest"
        return
    rows = dense_rows
    if not rows:
        probe = GGUFLinear(head.blocks[:HEAD_PROBE_ROWS], head.ggml_type, None)
        rows = measure([probe], [dtype])[0]
    if rows:
        head.fast, head.fast_rows = pack_dense(head, dtype), rows
        path.head_rows, path.dense_mib = rows, path.dense_mib + size / MIB
