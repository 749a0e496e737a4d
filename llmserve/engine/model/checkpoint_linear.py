"""Quantized checkpoints served as stored on the CPU: `keep_checkpoint_weights` swaps, before
the load, every Linear whose tensors a checkpoint stores in a form engine/model/kept_weights.py
holds (W4A16, W8A16, FP8) for a `CheckpointLinear` over them (kernels/cpu_wq.cpp), so the load
never widens them to float32, as engine/model/gguf_linear.py does for GGUF blocks (MoE experts:
engine/model/kept_experts.py, over the same CheckpointLinear). Linears left (the LM head of most
checkpoints, 2-bit weights) load dequantized as before.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from llmserve.common.log import get_logger
from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.families.deepseek import RopeRowsLinear
from llmserve.engine.model.kept_weights import KeptWeight
from llmserve.engine.model.layers import Linear
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.kernels import cpu_wq

log = get_logger(__name__)


def _same_columns(a: KeptWeight, b: KeptWeight) -> bool:
    if a.kind != b.kind or a.group != b.group or (a.perm is None) != (b.perm is None):
        return False
    return a.perm is None or b.perm is None or torch.equal(a.perm, b.perm)


def column_runs(parts: list[KeptWeight]) -> list[list[KeptWeight]]:
    """parts in runs of neighbours that read x in one column order (one kernel call a run; GPTQ
    act-order parts with their own orders each make a run of their own)."""
    runs: list[list[KeptWeight]] = []
    for part in parts:
        if runs and _same_columns(runs[-1][-1], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _merged(parts: list[KeptWeight]) -> KeptWeight:
    """Parts stacked in rows (fused q/k/v, gate/up): one kernel call for all, each part's
    integers first moved into the kernel's range (one part may be stored signed, one not)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    scale = torch.cat([p.scale for p in parts])
    if first.kind == "fp8":
        q = torch.cat([p.q.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
        return KeptWeight("fp8", q, scale, None, first.group, first.perm)
    if first.kind == "fp4":
        return KeptWeight("fp4", torch.cat([p.q for p in parts]), scale, None, first.group)
    moved = [cpu_wq.stored_values(first.kind, p.q, p.zero, p.scale) for p in parts]
    q = torch.cat([values for values, _ in moved])
    zeros = [
        torch.zeros(p.scale.shape) if z is None else z
        for p, (_, z) in zip(parts, moved, strict=True)
    ]
    return KeptWeight(first.kind, q, scale, torch.cat(zeros), first.group, first.perm)


def _rows(weight: KeptWeight, rows: torch.Tensor) -> KeptWeight:
    """The weight with its output rows in the order `rows` (DeepSeek's MLA projections: their
    rotary rows de-interleaved at load, engine/model/families/deepseek.py's RopeRowsLinear)."""
    zero = None if weight.zero is None else weight.zero[rows]
    return replace(weight, q=weight.q[rows], scale=weight.scale[rows], zero=zero)


class CheckpointLinear(nn.Module):
    """y = x W^T + b over a checkpoint's quantized weight as stored (kernels/cpu_wq.cpp), W
    stacking `parts` in rows. Parts that read the input in one column order share one kernel
    call; act-order parts with their own orders (each GPTQ projection may have its own) run one
    call each, on x gathered into that order, and their outputs are concatenated."""

    def __init__(self, parts: list[KeptWeight], bias: torch.Tensor | None):
        super().__init__()
        runs = column_runs(parts)
        self.segments = [
            (cpu_wq.pack_wq(w.kind, w.q, w.scale, w.zero, w.group), w.perm)
            for w in map(_merged, runs)
        ]
        self.kind = parts[0].kind
        self.in_features = parts[0].q.shape[1]
        self.bias = None if bias is None else bias.detach().float().clone()

    @property
    def nbytes(self) -> int:
        return sum(packed.nbytes for packed, _ in self.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if len(self.segments) == 1:
            packed, perm = self.segments[0]
            out = cpu_wq.wq_linear(rows if perm is None else rows[:, perm], packed, self.bias)
        else:
            outs = [
                cpu_wq.wq_linear(rows if perm is None else rows[:, perm], packed, None)
                for packed, perm in self.segments
            ]
            out = torch.cat(outs, dim=1)
            out = out if self.bias is None else out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def _linear_tensors(model: LlamaForCausalLM) -> dict[int, dict[str, list[str]]]:
    """id(Linear) -> the checkpoint names of its weight's and its bias's tensors."""
    names: dict[int, dict[str, list[str]]] = {}
    for name, module, param, _ in model.hf_tensors():
        if isinstance(module, Linear):
            kind = "weight" if param is module.weight else "bias"
            names.setdefault(id(module), {"weight": [], "bias": []})[kind].append(name)
    return names


def can_keep(model: LlamaForCausalLM, weights: CheckpointView) -> bool:
    """Whether a quantized checkpoint's weights can be kept as stored here: not where the
    checkpoint is float (no build), the model is split across tensor-parallel ranks (the kept
    forms are whole) or the kernel cannot build (logged once)."""
    if not weights.quantized or model.shard.tp.size != 1:
        return False
    if cpu_wq.unavailable() is not None:
        log.warning("checkpoint weights dequantized at load", why=cpu_wq.unavailable())
        return False
    return True


def keep_checkpoint_weights(model: LlamaForCausalLM, weights: CheckpointView) -> int:
    """Before the load: every Linear whose weight tensors `weights` holds in a kept form becomes
    a CheckpointLinear over them; the number swapped. Nothing where the kernel cannot build
    here or the model is split across tensor-parallel ranks (the kept forms are whole)."""
    if not can_keep(model, weights):
        return 0
    names = _linear_tensors(model)
    swapped = 0
    for name, module in list(model.named_modules()):
        if not (isinstance(module, Linear) and id(module) in names):
            continue
        parts = [weights.kept(n) for n in names[id(module)]["weight"]]
        kept = [p for p in parts if p is not None]
        if len(kept) != len(parts) or len({p.kind for p in kept}) != 1:
            continue
        if isinstance(module, RopeRowsLinear) and module.rows is not None:
            kept = [_rows(p, module.rows) for p in kept]
        biases = [weights[n].float() for n in names[id(module)]["bias"]]
        parent, _, leaf = name.rpartition(".")
        layer = CheckpointLinear(kept, torch.cat(biases) if biases else None)
        setattr(model.get_submodule(parent), leaf, layer)
        swapped += 1
    if swapped:
        log.info("checkpoint weights kept quantized", linears=swapped, kernel="cpu_wq",
                 avx512=cpu_wq.has_avx512())  # fmt: skip
    return swapped


def kept_description(model: nn.Module) -> str:
    """For the start line: how many linears serve their checkpoint's weights as stored on the CPU
    (on a GPU: checkpoint_linear_cuda.py's gpu_kept_description)."""
    kept = [(n, m.kind) for n, m in model.named_modules() if isinstance(m, CheckpointLinear)]
    if not kept:
        return ""
    kinds = [kind for _, kind in kept]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    experts = sum(".experts." in name for name, _ in kept)  # engine/model/kept_experts.py's
    of_them = f", {experts} of them experts'" if experts else ""
    return f"{len(kept)} linears kept quantized on the CPU ({counts}){of_them}"
