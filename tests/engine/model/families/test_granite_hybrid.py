"""Granite 4.0-H (GraniteMoeHybridForCausalLM) against transformers on tiny random checkpoints
of GraniteMoeHybridConfig (Mamba, attention, Mamba layers; Granite's multipliers): the whole
prompt's logits at every position; the prompt in two chunks with the Mamba states carried in
the engine's state pool, beside another request in another slot; token-by-token greedy decode;
the scheduled script (chunked prefill, preemption and recompute, n = 2, the prefix cache off)
through the real scheduler; what the family refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.engine.config import EngineConfig
from llmserve.engine.kv.state import StateBatch
from llmserve.engine.model.attention_context import AttentionContext
from llmserve.engine.parallel.ranks import run_group_locally
from llmserve.engine.step.engine import Engine
from tests.engine.model.families.test_qwen3_next import (
    _script_on_rank,
    check_rows,
    check_snapshot_hits,
    run_requests,
    script_requests,
)
from tests.engine.model.test_model import BLOCK_SIZE, NUM_BLOCKS, prompt, rel_err
from tests.factories import write_byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4
LAYERS = ["mamba", "attention", "mamba"]
VARIANTS: dict[str, dict[str, Any]] = {
    # the released models' shape: no rotary, MoE + shared MLP, multipliers != 1
    # (one group of B and C, as Granite 4.0-H's: split over ranks, the gated norm spans them)
    "moe_nope": dict(
        mamba_n_groups=1, num_local_experts=4, num_experts_per_tok=2, position_embedding_type=None,
        embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2,
        logits_scaling=2.5,
    ),
    # Granite-4.0-H-Micro's dense shape (shared MLP only), with rotary
    "dense_rope": dict(mamba_n_groups=2, num_local_experts=0, position_embedding_type="rope"),
}  # fmt: skip


def make_granite(directory: Path, variant: str, seed: int) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=32, intermediate_size=24, shared_intermediate_size=40,
        num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=4, layer_types=LAYERS, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, **VARIANTS[variant],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GraniteMoeHybridForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "mamba.D", "conv1d.bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


class Loaded:
    """One checkpoint loaded by transformers' `hf_class` and by our engine, with 4 state slots."""

    def __init__(self, path: Path, hf_class: str = "GraniteMoeHybridForCausalLM"):
        import transformers

        self.path = path
        self.hf = getattr(transformers, hf_class).from_pretrained(path).float().eval()
        config = EngineConfig(
            model=str(path), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
        )
        self.engine = Engine(config)

    @torch.no_grad()
    def forward(self, rows: list[tuple[list[int], int, int, int]]) -> list[torch.Tensor]:
        """One flattened step of rows (token_ids, start, end, slot): tokens [start, end) of
        each request (block table: blocks 8 r ..), from and into its state slot."""
        input_ids, positions, kv_slots, cu, seq_lens, tables = [], [], [], [0], [], []
        for r, (ids, start, end, _) in enumerate(rows):
            table = list(range(8 * r, 8 * r + 8))
            input_ids += ids[start:end]
            positions += range(start, end)
            kv_slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
            tables.append(table)
        ctx = AttentionContext(
            slot_mapping=torch.tensor(kv_slots), block_tables=torch.tensor(tables),
            seq_lens=seq_lens, cu_seqlens_q=cu, kv_caches=self.engine.runner.kv_caches,
            state=StateBatch(self.engine.state_pool, [slot for *_, slot in rows]),
        )  # fmt: skip
        model = self.engine.model
        logits = model.compute_logits(model(torch.tensor(input_ids), torch.tensor(positions), ctx))
        return [logits[cu[i] : cu[i + 1]] for i in range(len(rows))]

    @torch.no_grad()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(variant: str) -> Loaded:
        if variant not in cache:
            directory = tmp_path_factory.mktemp(variant)
            cache[variant] = Loaded(make_granite(directory, variant, seed=len(cache) + 7))
        return cache[variant]

    return get


def test_what_the_family_refuses(load: Any) -> None:
    """Speculative decoding, quantization and LoRA at start by name; the state pool is [Mamba
    layers, slots, ...] of the declared shapes."""
    for feature in ("speculative_decoding", "quantization"):
        why = family_refusal("granite_hybrid", [feature])
        assert why is not None and "GraniteMoeHybridForCausalLM" in why, feature
    engine = load("moe_nope").engine
    assert engine.state_pool.conv.shape[:2] == (2, engine.info.num_state_slots)
    assert engine.state_pool.recurrent.shape[2:] == (4, 8, 8)


def test_scheduled_script_matches_hf(load: Any) -> None:
    """test_qwen3_next's script through the real scheduler: chunked prefills, preemptions and
    recomputes, two requests of one prompt (n = 2), the prefix cache asked for and off; every
    sampled row as transformers' logits and greedy token."""
    m = load("moe_nope")
    m.engine.reset()
    requests = script_requests()
    script = run_requests(m.engine, requests)
    sched = script.sched
    assert script.num_partial_prefills > 0 and sched.counters.num_preemptions > 0
    assert sched.counters.num_prefix_cache_hit_tokens == 0 and not sched.enable_prefix_caching
    assert sched.state_slots.num_free_slots == sched.state_slots.num_slots
    check_rows(m, requests, script.rows)
    assert requests[0].token_ids == requests[1].token_ids


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_reads_the_layers_and_multipliers(load: Any, variant: str) -> None:
    config = load(variant).engine.model.config
    assert config.family == "granite_hybrid"
    assert config.layer_types == ("mamba", "full_attention", "mamba")
    groups = VARIANTS[variant]["mamba_n_groups"]
    assert config.mamba2 is not None and config.mamba2.conv_shape == (4 * 8 + 2 * groups * 8, 3)
    assert config.mamba2.ssm_shape == (4, 8, 8)
    nope = variant == "moe_nope"
    assert config.nope_layers == ((0, 1, 2) if nope else ())
    assert (config.moe is not None) == nope
    assert config.logits_scaling == (2.5 if nope else 1.0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_whole_prompt_all_positions(load: Any, variant: str) -> None:
    m = load(variant)
    ids = prompt(11, seed=3)
    (ours,) = m.forward([(ids, 0, 11, 0)])
    assert rel_err(ours, m.hf_logits(ids)) < TOLERANCE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunks_carry_the_state_beside_another_request(load: Any, variant: str) -> None:
    """Request A: [0, 6) alone in slot 2, then [6, 11) beside request B's whole prompt in slot
    0; then A's decode row (1 token: the recurrent form) beside B's: every position as
    transformers' whole prompt."""
    m = load(variant)
    a, b = prompt(12, seed=4), prompt(9, seed=5)
    (a1,) = m.forward([(a, 0, 6, 2)])
    a2, b1 = m.forward([(a, 6, 11, 2), (b, 0, 9, 0)])
    a3, b2 = m.forward([(a, 11, 12, 2), ([*b, 7], 9, 10, 0)])
    assert rel_err(torch.cat((a1, a2, a3)), m.hf_logits(a)) < TOLERANCE
    assert rel_err(torch.cat((b1, b2)), m.hf_logits([*b, 7])) < TOLERANCE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_decode_matches_transformers(load: Any, variant: str) -> None:
    """Prefill, then 8 tokens one at a time from the carried state (the recurrent form), as
    transformers' greedy choice over its whole-sequence forward at each step. (Not its
    `generate`: in transformers 5.25 on these models generate's first token in a fresh process
    can differ from its own forward's argmax, 224 against 151 for this prompt, while its forward
    with and without a cache agree with each other and with ours.)"""
    m = load(variant)
    ids = prompt(7, seed=6)
    want = list(ids)
    for _ in range(8):
        want.append(int(m.hf_logits(want)[-1].argmax()))
    tokens = list(ids)
    (logits,) = m.forward([(tokens, 0, len(tokens), 1)])
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = m.forward([(tokens, len(tokens) - 1, len(tokens), 1)])
    assert tokens == want


def test_tensor_and_pipeline_parallel_match_hf(load: Any) -> None:
    """T = 2 x P = 2, four gloo ranks, on the MoE model with one group of B and C: each rank 2
    of the 4 Mamba heads (their x, z and dt rows of in_proj, conv channels, A_log / D /
    dt_bias, norm weights, out_proj columns; B and C whole, the gated norm's squares summed
    across the two ranks), 1 of the 2 KV heads, 2 of the 4 experts, half the shared MLP; stage
    0 the first Mamba layer and the attention layer, stage 1 the second Mamba layer. The
    script gives transformers' rows on the driver and the same tokens on every rank; each
    rank's state pool holds its heads of its stage's Mamba layers."""
    m = load("moe_nope")
    config = EngineConfig(
        model=str(m.path), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        tensor_parallel_size=2, pipeline_parallel_size=2, num_threads=1, seed=0,
    )  # fmt: skip
    ranks = run_group_locally(config, _script_on_rank, timeout=300)
    tokens = ranks[0][0]
    rows = next(rank[1] for rank in ranks if rank[1])  # the driver's
    assert ranks[0][2] > 0 and all(rank[0] == tokens for rank in ranks)
    assert sorted(rank[3] for rank in ranks) == [(1, config.max_num_seqs, 2, 8, 8)] * 4
    requests = script_requests()
    for request, ids in zip(requests, tokens, strict=True):
        request.token_ids = ids
    check_rows(m, requests, rows)


def test_prefix_cache_hits_restore_a_state_snapshot(load: Any) -> None:
    """check_snapshot_hits (test_qwen3_next.py) on the Mamba-2 layers: two prefix-cache hits
    restored from the state snapshot the first request left, logits as transformers'."""
    model = load("moe_nope")
    check_snapshot_hits(model.path, model.hf_logits)
