"""Granite 4.0-H (GraniteMoeHybridForCausalLM) against transformers on tiny random checkpoints
of GraniteMoeHybridConfig (Mamba, attention, Mamba layers; Granite's multipliers): the whole
prompt's logits at every position; the prompt in two chunks with the Mamba states carried in
the engine's state pool, beside another request in another slot; token-by-token greedy decode;
the scheduled script (chunked prefill, preemption and recompute, n = 2, the prefix cache off)
through the real scheduler; what the family refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.engine.config import EngineConfig
from llmserve.engine.kv.state import StateBatch
from llmserve.engine.model.attention_context import AttentionContext
from llmserve.engine.step.engine import Engine
from tests.engine.model.families.test_qwen3_next import (
    check_group_script,
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
    return save_mamba2_model(model, directory)


def save_mamba2_model(model: Any, directory: Path) -> Path:
    """A tiny transformers Mamba-2 hybrid saved to directory with the byte tokenizer, its
    mixers' dt_bias, A_log, D and conv bias drawn wide and its norms moved off 1 (the
    initializer leaves them at values that would hide a misread)."""
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
    # no layer rotates: no cos/sin table kept (a GGUF's context is 2^20)
    rotary_rows = load(variant).engine.model.rotary_emb.cos_sin_cache.shape[0]
    assert (rotary_rows == 1) == nope


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


def gguf_twin(m: Loaded, path: Path) -> Loaded:
    """m's checkpoint written as llama.cpp's converter writes it (tests/mamba2_gguf) at path,
    checked for the same Mamba-2 state shapes and layer kinds as config.json's; a copy of m
    whose engine reads that GGUF (and whose reference is still m's transformers model)."""
    from tests.mamba2_gguf import write_mamba2_gguf

    write_mamba2_gguf(m.path, path)
    twin = copy.copy(m)
    config = EngineConfig(
        model=str(path), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
    )
    twin.engine = Engine(config)
    ours, want = twin.engine.model.config, m.engine.model.config
    assert ours.family == want.family and ours.layer_types == want.layer_types
    assert ours.mamba2 is not None and want.mamba2 is not None
    assert ours.mamba2.layout() == want.mamba2.layout()
    return twin


def check_prompt(m: Loaded) -> None:
    """A prompt prefilled whole but its last token, then that token as a decode row from its
    slot (the recurrent form): every position within TOLERANCE of transformers' logits, its
    greedy token at each."""
    ids = prompt(12, seed=4)
    (head,) = m.forward([(ids, 0, 11, 0)])
    (last,) = m.forward([(ids, 11, 12, 0)])
    got, want = torch.cat((head, last)), m.hf_logits(ids)
    assert rel_err(got, want) < TOLERANCE
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_from_a_gguf_as_llama_cpps_converter_writes_it(load: Any, tmp_path: Path) -> None:
    """`granitehybrid` (input_linear split into gate and up, A_log as -exp, q / k permuted, the
    multipliers as keys): its config as config.json's, a prompt as transformers', and
    test_qwen3_next's scheduled script (chunked prefill, preemption, n = 2) on the GGUF."""
    m = gguf_twin(load("moe_nope"), tmp_path / "granite.gguf")
    config, want = m.engine.model.config, load("moe_nope").engine.model.config
    for field in ("moe", "nope_layers", "intermediate_size", "logits_scaling"):
        assert getattr(config, field) == getattr(want, field), field
    assert config.attention_scale == pytest.approx(want.attention_scale)
    check_prompt(m)
    requests = script_requests()
    script = run_requests(m.engine, requests)
    assert script.num_partial_prefills > 0 and script.sched.counters.num_preemptions > 0
    check_rows(m, requests, script.rows)


def test_a_q8_0_gguf_is_served_dequantized(load: Any, tmp_path: Path) -> None:
    """The projections as Q8_0 blocks (the converter's --outtype q8_0): --quantization auto
    picks none (the family refuses quantization) and the blocks are dequantized at load; the
    logits within Q8_0's rounding of transformers' (measured 2.5%), the same greedy tokens."""
    from tests.mamba2_gguf import write_mamba2_gguf

    m = copy.copy(load("moe_nope"))
    path = write_mamba2_gguf(m.path, tmp_path / "q8.gguf", q8_0=True)
    config = EngineConfig(
        model=str(path), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
    )
    m.engine = Engine(config)
    assert m.engine.config.quantization == "auto" and m.engine.quantization == "none"
    ids = prompt(12, seed=4)
    (got,) = m.forward([(ids, 0, 12, 0)])
    want = m.hf_logits(ids)
    assert 1e-3 < rel_err(got, want) < 5e-2  # rounded, not exact
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_tensor_and_pipeline_parallel_match_hf(load: Any) -> None:
    """T = 2 x P = 2, four gloo ranks, on the MoE model with one group of B and C: each rank 2
    of the 4 Mamba heads (their x, z and dt rows of in_proj, conv channels, A_log / D /
    dt_bias, norm weights, out_proj columns; B and C whole, the gated norm's squares summed
    across the two ranks), 1 of the 2 KV heads, 2 of the 4 experts, half the shared MLP; stage
    0 the first Mamba layer and the attention layer, stage 1 the second Mamba layer. The
    script gives transformers' rows on the driver and the same tokens on every rank; each
    rank's state pool holds its heads of its stage's Mamba layers."""
    m = load("moe_nope")
    assert check_group_script(m) == [(1, 2, 8, 8)] * 4


@torch.inference_mode()
def test_decode_rows_through_the_ssd_kernel_on_the_emulator(load: Any) -> None:
    """The GPU path (StateKernelOps: kernels/ssd_step.cu for the Mamba layers' decode rows, on
    the kernel emulator) beside the CPU's torch ops, both bf16, on the two-group model (heads
    0-1 read group 0, 2-3 group 1): a prefill of two requests (20 and 7 tokens, slots 3 and
    1), then 3 decode steps of both. Hidden states and the conv pool within 1e-3, the fp32 SSM
    pool within 1e-5 (relative L2; 0.0 and 8e-10 measured: both paths give y in bf16, and
    ReferenceOps' fp32 y, before it did, moved the hidden states 1-2% apart over 3 steps). One
    launch per Mamba layer per decode step, none in the prefill (chunks stay on the torch
    chunked form); KernelOps runs the same kernel. And the ops pass select_ops's self-check at
    this model's widths."""
    from llmserve.engine.kv.cache import allocate_kv_cache, layer_views
    from llmserve.engine.kv.state import StatePool
    from llmserve.engine.model.ops import KernelOps, ReferenceOps, StateKernelOps, self_check
    from llmserve.engine.model.weights import build_model, load_weights
    from tests.engine.model.families.test_qwen3_next import _context
    from tests.kernel_emu import emu

    path = load("dense_rope").path
    config = load("dense_rope").engine.model.config
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    net = build_model(config, load_weights(path, config), 256, bf16, cpu)
    prompts, tables, slots = [prompt(20, seed=5), prompt(7, seed=6)], [[4, 1, 6], [2, 7, 0]], [3, 1]
    results = {}
    with emu.installed_or_skip() as emulator:
        for ops in (ReferenceOps(), StateKernelOps("torch+ssd_step.cu")):
            net.set_ops(ops)
            kv = layer_views(allocate_kv_cache(config, 8, BLOCK_SIZE, bf16, cpu))
            pool = StatePool(config, 4, bf16, cpu)
            tokens = [list(p) for p in prompts]
            hidden, launches = [], []
            for step in range(4):
                starts = [0, 0] if step == 0 else [len(t) - 1 for t in tokens]
                ctx = _context(kv, pool, tokens, starts, tables, slots)
                emulator.launches.clear()
                pairs = list(zip(tokens, starts, strict=True))
                ids = torch.tensor([x for t, s in pairs for x in t[s:]])
                pos = torch.tensor([p for t, s in pairs for p in range(s, len(t))])
                hidden.append(net(ids, pos, ctx))
                launches.append(len(emulator.launches))
                for t in tokens:
                    t.append((t[-1] * 7 + step) % config.vocab_size)
            results[ops.name] = hidden, pool.recurrent.clone(), pool.conv.clone(), launches
        assert self_check(StateKernelOps(), config, bf16, cpu, BLOCK_SIZE) is None
        kernel_launches = _kernel_ops_launches(emulator, KernelOps())
    net.set_ops(ReferenceOps())
    (want, want_pool, want_conv, none), (got, got_pool, got_conv, launched) = results.values()
    assert none == [0, 0, 0, 0] and launched == [0, 2, 2, 2]  # 2 Mamba layers
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(g.float(), w.float()) < 1e-3, step
    assert rel_err(got_pool, want_pool) < 1e-5 and rel_err(got_conv, want_conv) < 1e-3
    assert kernel_launches == (1, 0)


def _kernel_ops_launches(emulator: Any, ops: Any) -> tuple[int, ...]:
    """KernelOps.ssd_decode on 2 rows beside ReferenceOps' (y within 1%, the pool within 1e-5),
    without and with a clamp of dt (time_step_limit (0, 0.5): the kernel has none, torch runs
    it); how many kernels each launched."""
    from llmserve.engine.model.ops import ReferenceOps

    gen = torch.Generator().manual_seed(3)
    x, b, c = (
        torch.randn(2, *shape, generator=gen).bfloat16() for shape in ((4, 8), (2, 8), (2, 8))
    )
    dt, bias, d = torch.randn(2, 4, generator=gen), torch.randn(4, generator=gen), torch.ones(4)
    a, pool, slot_ids = -torch.rand(4, generator=gen), torch.randn(3, 4, 8, 8), torch.tensor([2, 0])
    launches = []
    for limit in ((0.0, float("inf")), (0.0, 0.5)):
        want_pool = pool.clone()
        want = ReferenceOps().ssd_decode(x, dt, bias, a, b, c, d, want_pool, slot_ids, limit)
        emulator.launches.clear()
        got = ops.ssd_decode(x, dt, bias, a, b, c, d, pool, slot_ids, limit)
        assert rel_err(got.float(), want.float()) < 1e-2 and rel_err(pool, want_pool) < 1e-5
        launches.append(len(emulator.launches))
    return tuple(launches)


def test_prefix_cache_hits_restore_a_state_snapshot(load: Any) -> None:
    """check_snapshot_hits (test_qwen3_next.py) on the Mamba-2 layers: two prefix-cache hits
    restored from the state snapshot the first request left, logits as transformers'."""
    model = load("moe_nope")
    check_snapshot_hits(model.path, model.hf_logits)
