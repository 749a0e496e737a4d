"""Our engine's logits against HF transformers' LlamaForCausalLM on tiny random checkpoints:
whole prompts, chunked prefill, decode, ragged batches over shuffled block tables, greedy tokens.

Error measure: max |ours - hf| / max |hf| over the compared logits, at most 1e-4 (float32).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.common.step_plan import NewRequest, RunningColumns, StepOutput, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.layers import rope_cos_sin_cache, rope_inv_freq
from llmserve.engine.model.ops import AttentionContext
from llmserve.engine.step.engine import Engine
from tests.factories import EOS_TOKEN_ID, LLAMA3, TINY_VOCAB, sampling

TOLERANCE = 1e-4
BLOCK_SIZE = 8
NUM_BLOCKS = 96
GREEDY = sampling(temperature=0.0)

# name -> how to build it: ("factory", kwargs for tests.factories.make_tiny_llama),
# ("classic", (base name, config.json edits)) or ("config", LlamaConfig overrides)
MODELS: dict[str, tuple[str, Any]] = {
    "gqa-untied": ("factory", {}),
    "mha-tied": ("factory", {"num_kv_heads": 4, "tie_word_embeddings": True, "seed": 1}),
    "gqa-tied": ("factory", {"tie_word_embeddings": True, "seed": 2}),
    "llama3-v5": ("factory", {"rope_scaling": LLAMA3, "seed": 3}),
    "linear-v5": ("factory", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "seed": 4}),
    # transformers 5 writes rope_parameters; these are written by hand in the classic spelling
    "llama3-classic": ("classic", ("llama3-v5", {"rope_theta": 20000.0, "rope_scaling": LLAMA3})),
    "linear-classic": (
        "classic",
        ("linear-v5", {"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}),
    ),
    "attention-bias": ("config", {"attention_bias": True}),
    "mlp-bias": ("config", {"mlp_bias": True, "num_key_value_heads": 1}),
}
ALL_MODELS = list(MODELS)


def make_from_config(directory: Path, seed: int, **overrides: Any) -> Path:
    """Like tests.factories.make_tiny_llama, for LlamaConfig fields it does not take. Biases (zero
    at init) and norms are randomized so they matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
    }
    fields.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


def write_classic_config(base: Path, directory: Path, edits: dict[str, Any]) -> Path:
    shutil.copytree(base, directory, dirs_exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(edits)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


class Loaded:
    """One checkpoint, loaded once by both our engine and HF."""

    def __init__(self, path: Path):
        from transformers import LlamaForCausalLM

        self.path = path
        self.hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.engine = Engine(
            EngineConfig(
                model=str(path), device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
            )
        )

    @torch.no_grad()
    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] float32, the request run alone."""
        return self.hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def load(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Loaded]:
    cache: dict[str, Loaded] = {}
    paths: dict[str, Path] = {}

    def path_of(name: str) -> Path:
        if name not in paths:
            kind, spec = copy.deepcopy(MODELS[name])  # transformers edits rope dicts in place
            if kind == "factory":
                paths[name] = tiny_model(**spec)
            elif kind == "classic":
                base, edits = spec
                target = tmp_path_factory.mktemp(name)
                paths[name] = write_classic_config(path_of(base), target, edits)
            else:
                seed = ALL_MODELS.index(name)
                paths[name] = make_from_config(tmp_path_factory.mktemp(name), seed, **spec)
        return paths[name]

    def get(name: str) -> Loaded:
        if name not in cache:
            cache[name] = Loaded(path_of(name))
        loaded = cache[name]
        loaded.engine.reset()
        return loaded

    return get


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float((ours - ref).abs().max() / ref.abs().max())


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(length)]


def shuffled_blocks(seed: int) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


# ---- direct forward calls: every position's logits -------------------------------------------


@torch.no_grad()
def forward_direct(
    engine: Engine, rows: list[tuple[list[int], int, int, list[int]]]
) -> list[torch.Tensor]:
    """One flattened forward of rows (token_ids, start, end, block_table): tokens [start, end) of
    each request, its earlier tokens already in the pool. Returns each row's logits
    [end - start, vocab]."""
    bs = BLOCK_SIZE
    input_ids, positions, slots, cu, seq_lens = [], [], [], [0], []
    for token_ids, start, end, table in rows:
        input_ids += token_ids[start:end]
        positions += range(start, end)
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        cu.append(cu[-1] + end - start)
        seq_lens.append(end)
    width = max(len(t) for *_, t in rows)
    ctx = AttentionContext(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for *_, t in rows]),
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        kv_caches=engine.runner.kv_caches,
    )
    hidden = engine.model(torch.tensor(input_ids), torch.tensor(positions), ctx)
    logits = engine.model.compute_logits(hidden)
    return [logits[cu[i] : cu[i + 1]] for i in range(len(rows))]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_whole_prompt_all_positions(load: Callable[[str], Loaded], name: str) -> None:
    m = load(name)
    tokens = prompt(45, seed=1)  # > 32: llama3 scaling's original context
    table = shuffled_blocks(11)[:6]
    (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), table)])
    assert rel_err(ours, m.hf_logits(tokens)) < TOLERANCE


@pytest.mark.parametrize("name", ALL_MODELS)
def test_chunked_prefill_all_positions(load: Callable[[str], Loaded], name: str) -> None:
    m = load(name)
    tokens = prompt(47, seed=2)
    table = shuffled_blocks(12)[:6]
    chunks = [
        forward_direct(m.engine, [(tokens, s, min(s + 7, len(tokens)), table)])[0]
        for s in range(0, len(tokens), 7)
    ]
    assert [c.shape[0] for c in chunks] == [7] * 6 + [5]
    assert rel_err(torch.cat(chunks), m.hf_logits(tokens)) < TOLERANCE


@pytest.mark.parametrize("name", ["llama3-v5", "linear-v5"])
def test_rope_scaling_matters_for_these_prompts(load: Callable[[str], Loaded], name: str) -> None:
    """Guards the scaled comparisons: the same weights with unscaled RoPE give other logits."""
    m = load(name)
    rotary = m.engine.model.rotary_emb
    unscaled = dataclasses.replace(m.engine.model_config, rope_scaling=None)
    saved = rotary.cos_sin_cache
    rotary.cos_sin_cache = rope_cos_sin_cache(rope_inv_freq(unscaled), rotary.max_positions)
    try:
        tokens = prompt(45, seed=1)
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(13)[:6])])
    finally:
        rotary.cos_sin_cache = saved
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_loader_reads_both_rope_spellings(load: Callable[[str], Loaded]) -> None:
    v5 = load_model_config(load("llama3-v5").path)
    classic = load_model_config(load("llama3-classic").path)
    assert v5.rope_theta == 10000.0 and classic.rope_theta == 20000.0
    assert v5.rope_scaling == classic.rope_scaling == LLAMA3
    linear = load_model_config(load("linear-classic").path)
    assert linear.rope_theta == 5000.0
    assert linear.rope_scaling is not None
    assert linear.rope_scaling["rope_type"] == "linear"
    assert linear.rope_scaling["factor"] == 4.0
    assert load_model_config(load("gqa-untied").path).rope_scaling is None
    biased = load_model_config(load("attention-bias").path)
    assert biased.attention_bias and not biased.mlp_bias


# ---- through Engine.step and the mirror ------------------------------------------------------


class Driver:
    """Plays the scheduler: builds StepPlanData for an engine, hands out blocks from a shuffled
    list, and records the logits each step samples from."""

    def __init__(self, engine: Engine, seed: int):
        self.engine = engine
        self.free = shuffled_blocks(seed)
        self.step_id = 0
        self.computed: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.captured: list[torch.Tensor] = []
        model = engine.model
        model.__dict__.pop("compute_logits", None)  # an earlier Driver's wrapper
        original = model.compute_logits

        def capture(hidden: torch.Tensor) -> torch.Tensor:
            logits = original(hidden)
            self.captured.append(logits.clone())
            return logits

        model.compute_logits = capture  # type: ignore[method-assign]

    def _grow(self, seq_id: int, end: int) -> list[int]:
        need = -(-end // BLOCK_SIZE) - len(self.tables[seq_id])
        blocks = [self.free.pop() for _ in range(max(need, 0))]
        self.tables[seq_id] += blocks
        return blocks

    def step(
        self,
        new: list[tuple[int, list[int], int]] | None = None,
        running: list[tuple[int, int]] | None = None,
        shared: dict[int, tuple[list[int], int]] | None = None,
    ) -> tuple[StepOutput, dict[int, tuple[list[int], torch.Tensor]]]:
        """new: (seq_id, token_ids, num_scheduled); running: (seq_id, num_scheduled); shared:
        seq_id -> (cached block ids, num cached tokens) for new requests hitting a prefix.
        Returns the output and, per sampled request, (its tokens so far, the logits row)."""
        new, running, shared = new or [], running or [], shared or {}
        self.step_id += 1
        self.captured.clear()
        new_reqs = []
        order: list[int] = []
        for seq_id, token_ids, num_sched in new:
            cached_blocks, num_cached = shared.get(seq_id, ([], 0))
            self.tables[seq_id] = list(cached_blocks)
            self.computed[seq_id] = num_cached
            self._grow(seq_id, num_cached + num_sched)
            table = list(self.tables[seq_id])
            new_reqs.append(
                NewRequest(seq_id, token_ids, len(token_ids), GREEDY, table, num_cached, num_sched)
            )
            order.append(seq_id)
        run = RunningColumns([], [], [], [], [])
        for seq_id, num_sched in running:
            blocks = self._grow(seq_id, self.computed[seq_id] + num_sched)
            run.seq_ids.append(seq_id)
            run.num_scheduled_tokens.append(num_sched)
            run.num_computed_tokens.append(self.computed[seq_id])
            run.num_new_blocks.append(len(blocks))
            run.new_block_ids += blocks
            order.append(seq_id)
        scheduled = [n for *_, n in new] + [n for _, n in running]
        out = self.engine.step(StepPlanData(self.step_id, [], new_reqs, run))
        logits = torch.cat(self.captured) if self.captured else torch.empty(0)
        sampled: dict[int, tuple[list[int], torch.Tensor]] = {}
        row = 0
        for seq_id, num_sched, token in zip(order, scheduled, out.sampled_token_ids, strict=True):
            self.computed[seq_id] += num_sched
            if token >= 0:
                tokens = self.engine.mirror.seqs[seq_id].token_ids[: self.computed[seq_id]]
                sampled[seq_id] = (tokens, logits[row])
                row += 1
        assert row == logits.shape[0]
        return out, sampled


def assert_matches_hf(m: Loaded, sampled: dict[int, tuple[list[int], torch.Tensor]]) -> None:
    for seq_id, (tokens, logits) in sampled.items():
        ref = m.hf_logits(tokens)[-1]
        err = rel_err(logits, ref)
        assert err < TOLERANCE, f"seq {seq_id} ({len(tokens)} tokens): rel err {err:.2e}"
        # greedy: the token appended is the argmax of our logits
        seq = m.engine.mirror.seqs[seq_id]
        assert seq.token_ids[len(tokens)] == int(logits.argmax())


@pytest.mark.parametrize("name", ALL_MODELS)
def test_engine_whole_prompt_then_decode(load: Callable[[str], Loaded], name: str) -> None:
    m = load(name)
    d = Driver(m.engine, seed=21)
    out, sampled = d.step(new=[(1, prompt(41, seed=4), 41)])
    assert out.logprobs is None and len(out.sampled_token_ids) == 1
    assert_matches_hf(m, sampled)
    for _ in range(4):
        _, sampled = d.step(running=[(1, 1)])
        assert_matches_hf(m, sampled)
    assert len(m.engine.mirror.seqs[1].token_ids) == 46


@pytest.mark.parametrize("name", ALL_MODELS)
def test_engine_chunked_prefill_then_decode(load: Callable[[str], Loaded], name: str) -> None:
    m = load(name)
    d = Driver(m.engine, seed=22)
    tokens = prompt(38, seed=5)
    out, sampled = d.step(new=[(1, tokens, 7)])
    assert out.sampled_token_ids == [-1] and not sampled
    for done in range(7, 35, 7):
        out, sampled = d.step(running=[(1, 7)])
        assert out.sampled_token_ids == [-1] and not sampled, done
        assert m.engine.mirror.seqs[1].token_ids == tokens  # mid-prefill: nothing appended
    out, sampled = d.step(running=[(1, 3)])
    assert list(sampled) == [1]
    assert_matches_hf(m, sampled)
    for _ in range(3):
        _, sampled = d.step(running=[(1, 1)])
        assert_matches_hf(m, sampled)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_engine_ragged_batch_matches_each_alone(load: Callable[[str], Loaded], name: str) -> None:
    """Prefill chunks, whole prompts, decodes and a prefix-cache hit in one flattened batch, with
    blocks handed out in shuffled order; each request's logits vs HF on that request alone."""
    m = load(name)
    d = Driver(m.engine, seed=23)
    a, b, c, e = prompt(45, 6), prompt(9, 7), prompt(33, 8), prompt(20, 9)
    _, sampled = d.step(new=[(1, a, 20), (2, b, 9), (3, c, 33), (4, [5], 1)])
    assert sorted(sampled) == [2, 3, 4]
    assert_matches_hf(m, sampled)

    _, sampled = d.step(new=[(5, e, 13)], running=[(3, 1), (1, 25), (2, 1), (4, 1)])
    assert sorted(sampled) == [1, 2, 3, 4]
    assert_matches_hf(m, sampled)

    # request 6 shares request 1's first two (full) blocks: 16 cached tokens
    f = a[:16] + prompt(14, 10)
    shared = {6: (d.tables[1][:2], 16)}
    _, sampled = d.step(
        new=[(6, f, 14)], running=[(5, 7), (4, 1), (1, 1), (2, 1), (3, 1)], shared=shared
    )
    assert sorted(sampled) == [1, 2, 3, 4, 5, 6]
    assert_matches_hf(m, sampled)

    for _ in range(2):
        _, sampled = d.step(running=[(i, 1) for i in (6, 2, 5, 3, 1, 4)])
        assert sorted(sampled) == [1, 2, 3, 4, 5, 6]
        assert_matches_hf(m, sampled)
    # the blocks really were non-contiguous and non-monotonic
    table = d.tables[1]
    assert any(y != x + 1 for x, y in itertools.pairwise(table))
    assert any(y < x for x, y in itertools.pairwise(table))


def test_direct_ragged_batch_all_positions(load: Callable[[str], Loaded]) -> None:
    """All positions of several requests in one forward, some with earlier context in the pool."""
    m = load("gqa-untied")
    blocks = shuffled_blocks(31)
    reqs = [prompt(n, 40 + n) for n in (30, 17, 52, 1, 8)]
    tables = [[blocks.pop() for _ in range(-(-len(t) // BLOCK_SIZE))] for t in reqs]
    # first: requests 0 and 2 get a head start of 11 / 24 tokens
    forward_direct(m.engine, [(reqs[0], 0, 11, tables[0]), (reqs[2], 0, 24, tables[2])])
    starts = [11, 0, 24, 0, 0]
    rows = [(t, s, len(t), tab) for t, s, tab in zip(reqs, starts, tables, strict=True)]
    outs = forward_direct(m.engine, rows)
    for tokens, start, out in zip(reqs, starts, outs, strict=True):
        assert rel_err(out, m.hf_logits(tokens)[start:]) < TOLERANCE


def test_greedy_tokens_match_hf_generate(load: Callable[[str], Loaded]) -> None:
    m = load("llama3-v5")
    tokens = prompt(30, seed=11)
    d = Driver(m.engine, seed=24)
    generated = [d.step(new=[(1, tokens, 30)])[0].sampled_token_ids[0]]
    for _ in range(15):
        generated += d.step(running=[(1, 1)])[0].sampled_token_ids
    m.hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = m.hf.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=0,
        )[0, len(tokens) :].tolist()
    assert len(ref) == 16
    assert generated == ref
    assert m.engine.mirror.seqs[1].token_ids == tokens + generated


def test_engine_logprobs_and_mid_prefill_rows(load: Callable[[str], Loaded]) -> None:
    m = load("gqa-untied")
    a, b, c = prompt(20, 50), prompt(12, 51), prompt(9, 52)
    greedy_lp = sampling(temperature=0.0, logprobs=True)
    seeded = sampling(temperature=0.8, top_k=5, seed=3, logprobs=True)
    plan = StepPlanData(
        1,
        [],
        [
            NewRequest(1, a, 20, greedy_lp, [9, 4, 30], 0, 10),  # mid-prefill
            NewRequest(2, b, 12, greedy_lp, [17, 2], 0, 12),
            NewRequest(3, c, 9, seeded, [60, 8], 0, 9),
        ],
        RunningColumns([], [], [], [], []),
    )
    out = m.engine.step(plan)
    assert out.logprobs is not None
    assert out.sampled_token_ids[0] == -1 and math.isnan(out.logprobs[0])
    ref_b = torch.log_softmax(m.hf_logits(b)[-1].double(), dim=-1)
    assert out.sampled_token_ids[1] == int(ref_b.argmax())
    assert out.logprobs[1] == pytest.approx(float(ref_b.max()), abs=1e-4)
    ref_c = torch.log_softmax(m.hf_logits(c)[-1].double(), dim=-1)
    token = out.sampled_token_ids[2]
    assert token in ref_c.topk(5).indices.tolist()
    assert out.logprobs[2] == pytest.approx(float(ref_c[token]), abs=1e-4)
    assert m.engine.mirror.seqs[1].token_ids == a
    assert m.engine.mirror.seqs[3].token_ids == [*c, token]
