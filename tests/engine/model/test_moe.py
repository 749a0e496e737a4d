"""The mixture-of-experts block (engine/model/moe.py, kernels/moe_reference.py) against
transformers' own sparse blocks, built from their config classes with random weights: 8 experts,
top-2, a shared expert for Qwen2-MoE; each rank's share of the experts under expert parallelism (the
whole model at T = 2 on gloo: tests/engine/model/families/test_moe_models.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.common.moe_config import MoEConfig, moe_from_hf
from llmserve.engine.model.layers import default_weight_loader
from llmserve.engine.model.moe import SparseMoeBlock
from llmserve.engine.model.ops import ReferenceOps
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels import moe_reference as moe_ref

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 32, 16, 24, 8, 2
STEM = "model.layers.0.mlp."
TOLERANCE = 1e-5


def hf_config(arch: str, **extra: Any) -> Any:
    """transformers' config object for a one-layer model of `arch`."""
    import transformers

    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_experts_per_tok=TOP_K)
    if arch == "MixtralForCausalLM":
        kwargs = dict(intermediate_size=INTER, num_local_experts=EXPERTS)
        return transformers.MixtralConfig(**common, **kwargs, **extra)
    kwargs = dict(moe_intermediate_size=INTER, num_experts=EXPERTS, intermediate_size=64)
    if arch == "Qwen2MoeForCausalLM":
        kwargs["shared_expert_intermediate_size"] = SHARED
        return transformers.Qwen2MoeConfig(**common, **kwargs, **extra)
    return transformers.Qwen3MoeConfig(**common, **kwargs, **extra)


def hf_block(arch: str, **extra: Any) -> tuple[torch.nn.Module, MoEConfig]:
    """transformers' sparse block for `arch`, its parameters seeded normal(0, 0.5), and our
    MoEConfig read from the same config as a config.json."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    classes = {
        "MixtralForCausalLM": MixtralSparseMoeBlock,
        "Qwen3MoeForCausalLM": Qwen3MoeSparseMoeBlock,
        "Qwen2MoeForCausalLM": Qwen2MoeSparseMoeBlock,
    }
    config = hf_config(arch, **extra)
    block = classes[arch](config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    moe = moe_from_hf({**config.to_dict(), "architectures": [arch]})
    assert moe is not None
    return block, moe


def hf_tensors(block: torch.nn.Module, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """The block's tensors under the checkpoint's names (what save_pretrained writes: one tensor
    per expert and projection)."""
    stem = STEM.removesuffix("mlp.") + f"{moe.hf_block}."
    gate, up, down = moe.hf_experts
    out = {f"{stem}gate.weight": block.gate.weight}
    for e in range(moe.num_experts):
        gate_up = block.experts.gate_up_proj[e]
        out[f"{stem}experts.{e}.{gate}.weight"] = gate_up[:INTER]
        out[f"{stem}experts.{e}.{up}.weight"] = gate_up[INTER:]
        out[f"{stem}experts.{e}.{down}.weight"] = block.experts.down_proj[e]
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{stem}shared_expert.{name}.weight"] = getattr(shared, name).weight
        out[f"{stem}shared_expert_gate.weight"] = block.shared_expert_gate.weight
    return {name: t.detach().clone() for name, t in out.items()}


@torch.no_grad()
def our_block(moe: MoEConfig, tensors: dict[str, torch.Tensor], tp: TPGroup | None = None) -> Any:
    """Our block for `moe`, its tensors loaded by name through each module's weight_loader."""
    block = SparseMoeBlock(HIDDEN, moe, ReferenceOps(), tp)
    targets = list(block.hf_tensors(STEM))
    assert len({name for name, *_ in targets}) == len(targets)
    for name, module, param, shard in targets:
        getattr(module, "weight_loader", default_weight_loader)(param, tensors[name], shard)
    return block.eval()


ARCHS = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_tokens", [37, 3])
def test_block_matches_transformers(arch: str, num_tokens: int) -> None:
    block, moe = hf_block(arch, norm_topk_prob=True) if "Qwen" in arch else hf_block(arch)
    ours = our_block(moe, hf_tensors(block, moe))
    x = torch.randn(1, num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)[0]
        got = ours(x[0])
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < TOLERANCE, f"{arch}: {err:.2e} from transformers' block"


def test_qwen_router_renormalizes_only_when_asked() -> None:
    """norm_topk_prob=False (Qwen's default): the top-k weights stay softmax probabilities."""
    block, moe = hf_block("Qwen3MoeForCausalLM", norm_topk_prob=False)
    assert not moe.renormalize
    ours = our_block(moe, hf_tensors(block, moe))
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (ours(x[0]) - block(x)[0]).abs().max().item()
    assert err < TOLERANCE
    weights, _ = moe_ref.route(ours.gate(x[0]), TOP_K, renormalize=False)
    assert bool((weights.sum(-1) < 1 - 1e-3).all()), "top-2 of 8 should not sum to 1"


def test_expert_shares_sum_to_the_whole() -> None:
    """Each rank's experts (kernels/moe_reference with first_expert) add up to all of them, and a
    rank with none of a step's experts gives zeros."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g)
    weights, ids = moe_ref.route(torch.randn(11, EXPERTS, generator=g), TOP_K, True)
    whole = moe_ref.moe_experts(x, weights, ids, w13, w2)
    parts = [
        moe_ref.moe_experts(x, weights, ids, w13[s:e], w2[s:e], s) for s, e in [(0, 3), (3, 8)]
    ]
    assert (parts[0] + parts[1] - whole).abs().max().item() < 1e-4
    none = moe_ref.moe_experts(x, weights, torch.zeros_like(ids), w13[4:], w2[4:], 4)
    assert not none.any()


def test_moe_config_reads_sparse_layers_and_names() -> None:
    config = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_hidden_layers": 6,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    moe = moe_from_hf(config)
    assert moe is not None and moe.dense_layers == (0, 2, 3, 4)
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert moe.shared_intermediate_size == 24 and not moe.renormalize
    assert moe_from_hf({"architectures": ["LlamaForCausalLM"]}) is None
    mixtral = moe_from_hf(
        {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2,
         "num_local_experts": 8, "intermediate_size": 16}
    )  # fmt: skip
    assert mixtral is not None and mixtral.renormalize and mixtral.hf_block == "block_sparse_moe"
    assert [mixtral.expert_range(r, 3) for r in range(3)] == [range(0, 2), range(2, 5), range(5, 8)]
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        MoEConfig(num_experts=8, top_k=9, intermediate_size=4, renormalize=True)
