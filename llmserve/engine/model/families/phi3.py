"""Phi-3 / Phi-4: Llama's layers; the checkpoint stores q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj`, split here into the parts the model loads one by one (so that tensor
parallelism takes each rank's rows of each part). Partial rotary and longrope are config data."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from llmserve.engine.model.model import LlamaForCausalLM


class SplitFused(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors, with each fused `<prefix>qkv_proj.<kind>` also readable as
    q_proj / k_proj / v_proj and `gate_up_proj` as gate_proj / up_proj (row slices)."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], parts: dict[str, list[tuple[str, int]]]
    ):
        self.weights = weights
        self.parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, start, rows)
        for fused in weights:
            stem, _, kind = fused.rpartition(".")
            prefix, _, leaf = stem.rpartition(".")
            start = 0
            for part, rows in parts.get(leaf, []):
                self.parts[f"{prefix}.{part}.{kind}"] = (fused, start, rows)
                start += rows

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.parts:
            fused, start, rows = self.parts[name]
            return self.weights[fused].narrow(0, start, rows)
        return self.weights[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.weights
        yield from self.parts

    def __len__(self) -> int:
        return len(self.weights) + len(self.parts)


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        parts = {
            "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)],
        }
        return SplitFused(weights, parts)
