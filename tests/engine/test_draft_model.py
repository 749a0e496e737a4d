"""Speculative decoding with a separate draft model (--speculative-model): tiny random models made
here, the engine in process through the real contract (tests/spec_driver.py), and the stack
started from the CLI. The draft's own paged KV is checked by a draft that is an exact copy of the
target: with right K/V it proposes exactly the target's greedy tokens, so every proposal is
accepted, across preemptions, recomputes and prefix-cache hits; a stale or missing K/V would
lower the acceptance."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from llmserve.common.model_config import ModelSourceError, check_draft_model, load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.scheduler.request import Request
from tests.factories import sampling
from tests.spec_driver import Driven, drive, make_scheduler_for

pytestmark = [pytest.mark.stack, pytest.mark.usefixtures("one_torch_thread")]

BS = 4
TARGET = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}
# Smaller in every way but the vocabulary: one layer, half the width, other heads.
SMALL_DRAFT = {
    "num_layers": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "seed": 1,
}


def _engine(model: Path, draft: Path | None = None, num_kv_blocks: int = 256, **fields: object):
    from llmserve.engine.step.engine import Engine

    method = "draft" if draft is not None else "none"
    config = EngineConfig(
        model=str(model), device="cpu", block_size=BS, num_kv_blocks=num_kv_blocks, seed=7,
        max_num_seqs=16, max_num_batched_tokens=64, speculative_method=method,
        speculative_model=str(draft) if draft is not None else None,
        num_speculative_tokens=4, **fields,  # type: ignore[arg-type]
    )  # fmt: skip
    return Engine(config)


# Prompts sharing a 12-token prefix (3 blocks: prefix-cache hits), then their own tokens.
SHARED = [5, 17, 33, 2, 101, 64, 9, 250, 77, 13, 40, 8]
PROMPTS = [SHARED + [(11 * s + i) % 250 + 1 for i in range(2 + 3 * s)] for s in range(6)]


def _run(
    engine: object, max_tokens: int = 40, params: object = None, **scheduler: object
) -> tuple[Driven, object]:
    sched = make_scheduler_for(engine, max_num_batched_tokens=64, **scheduler)
    requests = [
        Request(f"r{i}", i + 1, p, params or sampling(temperature=0.0), max_tokens, ignore_eos=True)  # type: ignore[arg-type]
        for i, p in enumerate(PROMPTS)
    ]
    return drive(sched, engine, requests), sched


@pytest.fixture(scope="module")
def target(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(**TARGET)


@pytest.fixture(scope="module")
def baseline(target: Path) -> dict[int, list[int]]:
    """Greedy outputs without speculation."""
    return _run(_engine(target))[0].outputs


def test_exact_copy_draft_accepts_every_proposal(
    target: Path, baseline: dict[int, list[int]]
) -> None:
    """The target itself as the draft, 20 blocks of 4 tokens for 6 requests of up to 69 tokens
    (preempted and recomputed), sharing a 3-block prefix (prefix-cache hits): every proposal
    accepted, the tokens decoding without speculation gives, every block free after."""
    run, sched = _run(_engine(target, target, num_kv_blocks=20))
    assert run.outputs == baseline
    counters = sched.counters  # type: ignore[attr-defined]
    spec = counters.spec
    assert counters.num_preemptions > 0
    assert counters.num_prefix_cache_hit_tokens > 0
    assert spec.num_spec_rows > 30, spec
    assert spec.num_spec_accepted_tokens == spec.num_spec_draft_tokens, spec


def test_small_draft_greedy_identity_with_preemption(
    tiny_model: Callable[..., Path], target: Path, baseline: dict[int, list[int]]
) -> None:
    """A smaller random draft (its proposals mostly wrong: rejections, rollbacks, back-off and
    catch-up after it), preemptions forced: the same tokens as without speculation."""
    draft = tiny_model(**SMALL_DRAFT)
    engine = _engine(target, draft, num_kv_blocks=20)
    assert engine.draft_kv_cache.shape[:2] == (1, 2)  # type: ignore[attr-defined]
    assert engine.draft_kv_cache.shape[2] == engine.num_blocks == 20  # type: ignore[attr-defined]
    run, sched = _run(engine)
    assert run.outputs == baseline
    counters = sched.counters  # type: ignore[attr-defined]
    assert counters.num_preemptions > 0
    assert counters.spec.num_spec_draft_tokens > counters.spec.num_spec_accepted_tokens


def test_seeded_temperature_same_tokens_with_a_draft(
    tiny_model: Callable[..., Path], target: Path
) -> None:
    """Seeded sampling at temperature 0.8 with top-k, top-p and a penalty: the same tokens with
    the separate draft (the exact copy: many proposals accepted, some not) as without."""
    params = sampling(temperature=0.8, top_k=40, top_p=0.9, seed=11, frequency_penalty=0.3)
    plain = _run(_engine(target), max_tokens=24, params=params)[0]
    spec, sched = _run(_engine(target, target), max_tokens=24, params=params)
    assert spec.outputs == plain.outputs
    counters = sched.counters.spec  # type: ignore[attr-defined]
    assert 0 < counters.num_spec_accepted_tokens < counters.num_spec_draft_tokens


def test_draft_pool_counts_in_the_cpu_pool_size(target: Path, tiny_model: Callable[..., Path]):
    """--kv-cache-gb holds both pools: as many blocks in each, fewer than the target alone."""
    from llmserve.engine.kv.cache import bytes_per_block
    from llmserve.engine.step.memory import choose_num_blocks

    torch = pytest.importorskip("torch")
    config = EngineConfig(kv_cache_gb=0.001, block_size=BS)
    target_config = load_model_config(target)
    draft_config = load_model_config(tiny_model(**SMALL_DRAFT))
    alone = choose_num_blocks(config, target_config, torch.float32)
    both = choose_num_blocks(config, target_config, torch.float32, draft_config=draft_config)
    per_block = bytes_per_block(target_config, BS, torch.float32) + bytes_per_block(
        draft_config, BS, torch.float32
    )
    assert both == int(0.001 * (1 << 30)) // per_block < alone


# -- refusals -------------------------------------------------------------------------------------


def _copy_with(source: Path, directory: Path, **config: object) -> Path:
    """source's config.json and tokenizer files in directory, config.json's fields changed."""
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    data = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return directory


def test_vocab_mismatch_refused_naming_both(target: Path, tmp_path: Path) -> None:
    draft = _copy_with(target, tmp_path / "draft", vocab_size=300)
    with pytest.raises(
        ModelSourceError, match=r"vocab_size=300 differs from the model's vocab_siz"
    ):
        _engine(target, draft)  # refused before any weights load (the draft has none)


def test_token_mismatch_refused_naming_both(target: Path, tmp_path: Path) -> None:
    draft = _copy_with(target, tmp_path / "draft")
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["zz"] = vocab.pop(next(t for t, i in vocab.items() if i == 65))
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    target_config, draft_config = load_model_config(target), load_model_config(draft)
    with pytest.raises(ModelSourceError, match=r"token 65 is 'zz' in its tokenizer.json but 'A'"):
        check_draft_model(target, target_config, draft, draft_config)
    check_draft_model(target, target_config, target, target_config)  # the same: accepted


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="needs speculative_method='draft', not 'ngram'"):
        EngineConfig(speculative_method="ngram", speculative_model="x")
    with pytest.raises(ValueError, match="needs speculative_method='draft', not 'none'"):
        EngineConfig(speculative_model="x")
    with pytest.raises(ValueError, match="draft_num_layers=2 is for self-speculation"):
        EngineConfig(speculative_method="draft", speculative_model="x", draft_num_layers=2)


def test_short_context_draft_refused(target: Path, tmp_path: Path) -> None:
    draft = _copy_with(target, tmp_path / "draft", max_position_embeddings=64)
    with pytest.raises(ModelSourceError, match="max_position_embeddings=64 is below the engine's"):
        _engine(target, draft)


# -- the stack, started from the CLI's flags ------------------------------------------------------


def test_stack_with_a_draft_model(target: Path, tmp_path: Path) -> None:
    """`--speculative-method draft --speculative-model` (the target's copy) through engine,
    scheduler and gateway: 4 greedy requests at once give the tokens the same stack gives them
    with speculation turned off per request (over gRPC, then over HTTP), every proposal
    accepted, every block free after; the engine's log names the draft and its pool."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx2

    from llmserve.client import make_request
    from tests.stack import start_stack

    stack = start_stack(
        target,
        engine_args=[
            "--num-kv-blocks", "64", "--speculative-method", "draft",
            "--speculative-model", str(target), "--num-speculative-tokens", "3",
        ],
        log_dir=tmp_path,
        http=True,
    )  # fmt: skip
    try:
        texts = [f"draft {i}: the quick brown fox" for i in range(4)]

        def generate(text: str, off: bool) -> list[int]:
            request = make_request(
                text=text, max_tokens=24, temperature=0.0, ignore_eos=True, disable_speculation=off
            )
            with stack.client() as client:
                return list(client.generate(request).token_ids)

        plain = [generate(t, True) for t in texts]
        assert stack.stats().num_spec_rows == 0
        with ThreadPoolExecutor(4) as pool:
            spec = list(pool.map(lambda t: generate(t, False), texts))
        assert spec == plain
        # The OpenAI API speculates as gRPC does, and its per-request switch turns it off.
        body = {"model": "x", "prompt": texts[0], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        url = f"{stack.http_url}/completions"
        before = stack.stats().num_spec_rows
        off = httpx2.post(url, json={**body, "disable_speculation": True}).json()
        assert stack.stats().num_spec_rows == before
        on = httpx2.post(url, json=body).json()
        assert stack.stats().num_spec_rows > before
        assert on["choices"][0]["text"] == off["choices"][0]["text"] != ""
        stats = stack.assert_idle()
        assert stats.num_spec_rows > 0
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens > 0
    finally:
        stack.close()
    engine_log = "".join(p.read_text() for p in tmp_path.glob("*engine*"))
    assert "draft_kv_cache_gib" in engine_log and str(target) in engine_log


def test_serve_refuses_a_draft_of_another_vocabulary(target: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.stack import ROOT

    draft = _copy_with(target, tmp_path / "draft", vocab_size=300)
    out = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(target),
         "--speculative-method", "draft", "--speculative-model", str(draft)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "vocab_size=300 differs from the model's vocab_size=259" in out.stderr


# -- the built-in model and a draft cut from it --------------------------------------------------


def test_builtin_model_with_a_draft_cut_by_the_script(
    builtin_model_path: Path, tmp_path: Path
) -> None:
    """scripts/make_draft_model.py's draft (the built-in GGUF's first 3 layers, tokenizer and
    Q4_1 bytes as stored) passes the token check against the built-in model, loads as int8 as
    the target does, and greedy decoding with it gives the tokens of a request that does not
    speculate, in the same batch."""
    from llmserve.engine.step.engine import Engine
    from scripts.make_draft_model import make_draft

    draft = tmp_path / "draft.gguf"
    assert make_draft(builtin_model_path, draft, 3) == [0, 1, 2]
    target_config, draft_config = load_model_config(builtin_model_path), load_model_config(draft)
    assert (draft_config.num_layers, draft_config.hidden_size) == (3, target_config.hidden_size)
    check_draft_model(builtin_model_path, target_config, draft, draft_config)
    config = EngineConfig(
        device="cpu", num_kv_blocks=64, seed=7, speculative_method="draft",
        speculative_model=str(draft), num_speculative_tokens=3,
    )  # fmt: skip
    engine = Engine(config)
    linear = type(engine.model.layers[0].self_attn.qkv_proj)
    assert type(engine.draft_model.layers[0].self_attn.qkv_proj) is linear  # type: ignore[union-attr]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    requests = [
        Request(f"r{i}", i + 1, prompt, sampling(temperature=0.0), 12, disable_speculation=off)
        for i, off in enumerate((True, False))
    ]
    sched = make_scheduler_for(engine)
    run = drive(sched, engine, requests)
    assert run.outputs[1] == run.outputs[2]
    assert sched.counters.spec.num_spec_rows > 0
