"""Token trees (SpecInfer, engine/features/token_tree.py): the n-gram and draft trees, the tree
walk, the tree attention mask against attention over each branch alone, and through the
scheduler and engine in one process: greedy and seeded output identical to decoding without
speculation (chunked prefill, preemptions, accepted side branches whose K/V is moved), and a
chi-square test that sampling at temperature 1 keeps the target's distribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.features import token_tree as tt
from llmserve.kernels import reference as ref
from llmserve.scheduler.request import Request
from tests.engine.test_speculative import _chi_square_critical, _engine, _homogeneity
from tests.factories import sampling
from tests.spec_driver import drive, make_scheduler_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ngram_tree_one_branch_per_distinct_continuation() -> None:
    #         0  1  2  3  4  5  6  7  8  9  10 11
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    # [1, 2] matched at 6 (-> 3 9), 3 (-> 4 1), 0 (-> 3 1: shares its first token with 6's)
    nodes, parents = tt.ngram_tree(tokens, 16, 2, 3, 1, 2)
    assert nodes == [3, 9, 4, 1, 1] and parents == [-1, 0, -1, 2, 0]
    assert tt.ngram_tree(tokens, 3, 2, 3, 1, 2) == ([3, 9, 4], [-1, 0, -1])  # node budget
    assert tt.ngram_tree(tokens, 16, 2, 1, 1, 2) == ([3, 9], [-1, 0])  # width 1: the chain
    assert tt.ngram_tree([5, 6, 7], 8, 4, 2, 1, 2) == ([], [])  # no match


def test_walk_siblings_and_main_chain() -> None:
    tokens, parents = tt.with_siblings([10, 11, 12], [[20], [11, 21], []], 5)
    assert tokens == [10, 11, 12, 20, 21] and parents == [-1, 0, 1, -1, 0]
    assert tt.node_depths(parents) == [1, 2, 3, 1, 2] and tt.tree_depth(parents) == 3
    # sampled: at the root, then at each node
    assert tt.accept_path([10, 21, 0, 0, 0, 0], tokens, parents) == [0, 4]
    assert tt.accept_path([20, 0, 0, 0, 7, 0], tokens, parents) == [3]
    assert tt.accept_path([10, 11, 12, 5, 0, 0], tokens, parents) == [0, 1, 2]
    assert tt.accept_path([9, 0, 0, 0, 0, 0], tokens, parents) == []
    assert tt.main_chain_prefix([0, 4], parents) == 1
    assert tt.path_tokens(tokens, parents, 4) == [10, 21]


def test_tree_attention_equals_each_branch_alone() -> None:
    """A row of 5 known tokens and the tree root -> a -> b, root -> c, attended with the tree
    mask over the paged pool: each node's output equals causal attention over the known
    tokens and its own path, stored consecutively."""
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, known = 4, 4, 2, 8, 5
    parents = [-1, 0, -1]
    n = len(parents)
    k_all = torch.randn(known + n, kv_heads, dim)
    v_all = torch.randn(known + n, kv_heads, dim)
    q = torch.randn(2 + n, heads, dim)  # the last two known tokens' queries, then the nodes'
    k_cache = torch.zeros(4, bs, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[2, 0, 3]])
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(known + n)])
    ref.store_kv(k_all, v_all, k_cache, v_cache, slots)
    mask, k_pos = tt.row_attention(known, known - 2, parents)
    assert k_pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 5]
    out = ref.paged_attention(
        q, k_cache, v_cache, table, [known + n], [0, 2 + n], 0.5, trees=[(mask, k_pos)]
    )
    for row, keys in [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3, 4]), (2, [0, 1, 2, 3, 4, 5]),
                      (3, [0, 1, 2, 3, 4, 5, 6]), (4, [0, 1, 2, 3, 4, 7])]:  # fmt: skip
        k = k_all[keys].repeat_interleave(2, dim=1).transpose(0, 1)
        v = v_all[keys].repeat_interleave(2, dim=1).transpose(0, 1)
        expected = torch.softmax(q[row][:, None] @ k.transpose(1, 2) * 0.5, -1) @ v
        torch.testing.assert_close(out[row], expected[:, 0], msg=f"query row {row}")


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the K/V slots moved after verifications (accepted nodes off the main chain)."""
    import llmserve.engine.step.runner as runner

    counted: list[int] = []
    real = runner.compact_kv

    def counting(kv_caches: list, pairs: list) -> None:
        counted.append(len(pairs))
        real(kv_caches, pairs)

    monkeypatch.setattr(runner, "compact_kv", counting)
    return counted


TEXT = (
    "Repeat: the cat sat on the mat, the cat ran to the door, the cat sat on the rug. Again: "
    "the cat"
)


def test_greedy_and_seeded_identity_with_trees(builtin_model_path: Path, moves: list[int]) -> None:
    """Two greedy requests and a seeded one (top-k, penalties) on the built-in model, 4-token
    blocks, 16-token steps (chunked prefill) and 13 blocks (preemptions): n-gram trees of
    width 3 and the self-speculating draft's width-2 trees give exactly the tokens decoding
    without speculation does; side branches were accepted (their K/V moved) and no block
    leaked (tests/spec_driver.drive checks every step)."""
    from llmserve.gateway.tokenizer import Tokenizer

    prompt = Tokenizer.from_model_path(builtin_model_path).encode(TEXT)
    params = [
        sampling(temperature=0.0),
        sampling(temperature=0.0),
        sampling(temperature=0.8, top_k=20, seed=5, frequency_penalty=0.2),
    ]
    from llmserve.engine.step.engine import Engine

    outputs = {}
    for name, method, width in [("ngram", "ngram", 3), ("draft", "draft", 2)]:
        # gguf, not auto: auto's crossover, timed at each engine's start, may give the second
        # engine another weight form (other rounding) than the first
        config = EngineConfig(
            model=str(builtin_model_path), device="cpu", num_kv_blocks=13, block_size=4,
            seed=7, speculative_method=method, speculative_tree_width=width, quantization="gguf",
        )  # fmt: skip
        engine = Engine(config)
        # "none": the n-gram engine with speculation off per request (the plain decode path)
        for run in ["none", name] if name == "ngram" else [name]:
            scheduler = make_scheduler_for(engine, max_num_batched_tokens=16)
            requests = [
                Request(f"r{i}", i + 1, prompt[i:], p, 10, ignore_eos=True)
                for i, p in enumerate(params)
            ]
            for r in requests:
                r.disable_speculation = run == "none"
            outputs[run] = drive(scheduler, engine, requests).outputs
            engine.reset()
            assert scheduler.counters.num_preemptions > 0, run
            spec = scheduler.counters.spec
            assert (spec.num_spec_rows > 0) == (run != "none"), run
    assert outputs["ngram"] == outputs["none"]
    assert outputs["draft"] == outputs["none"]
    assert sum(moves) > 0, "no side branch accepted"


def test_temperature_one_distribution_unchanged_with_trees(
    tiny_model: Callable[..., Path], moves: list[int]
) -> None:
    """As test_speculative's chain version: outputs 1-3 of 800 requests at temperature 1,
    decoded with the draft's trees (depth 3, its top 2 tokens at each depth) against 800
    without, Pearson's homogeneity test per output index under its 0.999 quantile; side
    branches were accepted, and proposals both accepted and rejected."""
    model = tiny_model(num_heads=4, num_kv_heads=2, initializer_range=1.0)
    prompt = [10, 20, 30, 40, 50]
    n = 800
    counts = {}
    for method in ("none", "draft"):
        engine = _engine(
            model, method, num_speculative_tokens=3, draft_num_layers=2,
            speculative_tree_width=2 if method == "draft" else 1,
        )  # fmt: skip
        scheduler = make_scheduler_for(engine, max_num_batched_tokens=4096)
        requests = [
            Request(f"r{i}", i + 1, prompt, sampling(), 8, ignore_eos=True) for i in range(n)
        ]
        run = drive(scheduler, engine, requests)
        counts[method] = [Counter(run.outputs[i + 1][j] for i in range(n)) for j in (1, 2, 3)]
        if method == "draft":
            spec = scheduler.counters.spec
            accepted, draft = spec.num_spec_accepted_tokens, spec.num_spec_draft_tokens
            assert 0.1 * draft < accepted < 0.9 * draft, spec
            assert sum(moves) > 0, "no side branch accepted"
    for j in range(3):
        stat, dof = _homogeneity(counts["none"][j], counts["draft"][j])
        assert dof >= 3, f"output {j + 1}: too few tokens to test ({dof} degrees of freedom)"
        assert stat < _chi_square_critical(dof), f"output {j + 1}: chi-square {stat:.1f}, {dof} dof"


def test_tree_settings_checked() -> None:
    assert (
        EngineConfig(speculative_method="ngram", speculative_tree_width=3).num_lookahead_slots == 12
    )
    config = EngineConfig(
        speculative_method="ngram", speculative_tree_width=3, num_speculative_nodes=8
    )
    assert config.num_lookahead_slots == 8
    with pytest.raises(ValueError, match="num_speculative_nodes=2 must be in"):
        EngineConfig(speculative_method="ngram", speculative_tree_width=2, num_speculative_nodes=2)
    with pytest.raises(ValueError, match="needs speculative_tree_width > 1"):
        EngineConfig(speculative_method="ngram", num_speculative_nodes=8)
    with pytest.raises(ValueError, match="speculative_tree_width=0"):
        EngineConfig(speculative_method="ngram", speculative_tree_width=0)
    with pytest.raises(ValueError, match="at most 64"):
        EngineConfig(
            speculative_method="ngram", speculative_tree_width=8, num_speculative_tokens=16
        )


def test_separate_draft_model_trees_seeded_identity(
    tiny_model: Callable[..., Path], moves: list[int]
) -> None:
    """A separate draft model (the target's copy, its own pool) proposing width-2 trees, seeded
    sampling at temperature 0.8 with top-k and a penalty: the tokens decoding without
    speculation gives; side branches accepted (the draft's computed tokens cut back to the
    accepted prefix of its chain)."""
    model = tiny_model(num_heads=4, num_kv_heads=2, initializer_range=1.0)
    params = sampling(temperature=0.8, top_k=40, seed=11, frequency_penalty=0.3)
    outputs = {}
    for name, fields in [
        ("none", {}),
        ("tree", {"speculative_model": str(model), "speculative_tree_width": 2}),
    ]:
        engine = _engine(model, "draft" if fields else "none", num_speculative_tokens=3, **fields)
        scheduler = make_scheduler_for(engine)
        requests = [
            Request(f"r{i}", i + 1, [10 + i, 20, 30, 40], params, 12, ignore_eos=True)
            for i in range(8)
        ]
        outputs[name] = drive(scheduler, engine, requests).outputs
    assert outputs["tree"] == outputs["none"]
    assert sum(moves) > 0, "no side branch accepted"
