"""Every served non-Llama family against HF transformers on a tiny random checkpoint of its own
config class (tests/family_models.py), from its HF directory and from a GGUF: logits within 1e-4
(float32) at every position of a whole prompt and of a chunked prefill, and at every sampled
position of a scheduler-driven script with chunked prefill, prefix-cache hits and preemptions;
the registry's refusals."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import ModelSourceError, load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto, result_to_proto
from llmserve.engine.step.engine import Engine
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import apply_result, plan_to_proto
from tests.engine.model.test_model import (
    BLOCK_SIZE,
    forward_direct,
    prompt,
    rel_err,
    shuffled_blocks,
)
from tests.factories import sampling
from tests.family_models import ENGINE_SETTINGS, FAMILY_CONFIGS, make_tiny_family
from tests.spec_driver import check_mirror

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4
FAMILIES = list(FAMILY_CONFIGS)
NUM_OUT = 16


class Loaded:
    """One family's checkpoint, loaded by our engine and by HF."""

    def __init__(self, path: Path, **engine: Any):
        from tests.family_models import load_hf

        self.path = path
        self.hf = load_hf(path)
        config = {"num_kv_blocks": 96, "block_size": BLOCK_SIZE, **engine}
        self.engine = Engine(EngineConfig(model=str(path), device="cpu", **config))

    @torch.no_grad()
    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(family: str, **overrides: Any) -> Loaded:
        """The family's tiny model (overrides: config fields changed), loaded once."""
        key = f"{family}{overrides}"
        if key not in cache:
            directory = tmp_path_factory.mktemp(family)
            path = make_tiny_family(directory, family, seed=len(cache), **overrides)
            cache[key] = Loaded(path, **ENGINE_SETTINGS.get(family, {}))
        cache[key].engine.reset()
        return cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_registry_reads_the_family(load: Any, family: str) -> None:
    config = load_model_config(load(family).path)
    assert config.family == family
    assert (
        type(load(family).engine.model)
        .__name__.lower()
        .startswith({"qwen2": "llama", "mistral": "llama"}.get(family, family))
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_prompt_and_chunks_all_positions(load: Any, family: str) -> None:
    m = load(family)
    tokens = prompt(45, seed=1)
    want = m.hf_logits(tokens)
    (whole,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, want) < TOLERANCE
    table = shuffled_blocks(12)[:6]
    chunks = [
        forward_direct(m.engine, [(tokens, s, min(s + 7, len(tokens)), table)])[0]
        for s in range(0, len(tokens), 7)
    ]
    assert rel_err(torch.cat(chunks), want) < TOLERANCE


class Script:
    """What run_script saw: the scheduler, per seq id the logits rows its tokens were sampled
    from (in order), and the blocks held after each plan."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.held: list[int] = []
        self.num_partial_prefills = 0  # prefill chunks that sampled nothing (more followed)


def run_script(
    engine: Engine,
    requests: list[Request],
    num_blocks: int,
    release_window: bool = True,
    **config: Any,
) -> Script:
    """Drive the requests through a real scheduler of num_blocks blocks (protobuf both ways)
    until idle, the blocks out of a model-wide sliding window released unless release_window is
    False."""
    info = engine.info
    sched = Scheduler(
        SchedulerConfig(**{"max_num_seqs": info.max_num_seqs, **config}),
        num_blocks, info.block_size, info.max_model_len, info.vocab_size, info.eos_token_ids,
        num_state_slots=info.num_state_slots,
        num_state_snapshot_slots=info.num_state_snapshot_slots,
    )  # fmt: skip
    if release_window:
        sched.set_sliding_window(info.sliding_window)
    script = Script(sched)
    rows = script.rows
    captured: list[torch.Tensor] = []
    model = engine.model
    original = model.compute_logits
    model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]  # type: ignore[method-assign]
    try:
        for request in requests:
            sched.add(request)
        while sched.has_work:
            plan = sched.schedule()
            manager = sched.block_manager
            script.held.append(manager.num_blocks - manager.num_free_blocks)
            if plan.is_empty:
                continue
            captured.clear()
            data = plan_from_proto(plan_to_proto(plan))
            output = engine.step(data)
            order = [r.seq_id for r in data.new_requests] + list(data.running.seq_ids)
            logits = iter(torch.cat(captured)) if captured else None  # None: an earlier stage
            for seq_id, token in zip(order, output.sampled_token_ids, strict=True):
                if token >= 0:
                    if logits is not None:
                        rows.setdefault(seq_id, []).append(next(logits))
                else:
                    script.num_partial_prefills += 1
            apply_result(sched, plan, result_to_proto(plan.step_id, output, 0.0))
            sched.check_integrity()
            check_mirror(sched, engine)
    finally:
        del model.compute_logits
    return script


def check_script_matches_hf(
    engine: Engine,
    hf_logits: Callable[[list[int]], torch.Tensor],
    num_requests: int,
    num_out: int,
    num_blocks: int,
    release_window: bool = True,
) -> None:
    """num_requests requests of 30-50 tokens sharing a 16-token prefix, num_out tokens out, in
    num_blocks blocks of 8 (of the engine's 96) with 40-token steps: chunked prefills,
    prefix-cache hits, preemptions and recomputes, each asserted to have happened; each sampled
    row within 1e-4 of HF's logits at that position of the request's final tokens."""
    shared = prompt(16, seed=3)
    greedy = sampling(temperature=0.0)
    requests = [
        Request(f"r{i}", i + 1, shared + prompt(14 + 4 * i, seed=10 + i), greedy, num_out,
                ignore_eos=True)  # type: ignore[arg-type]
        for i in range(num_requests)
    ]  # fmt: skip
    script = run_script(engine, requests, num_blocks, release_window, max_num_batched_tokens=40)
    sched, rows = script.sched, script.rows
    assert script.num_partial_prefills > 0
    assert sched.counters.num_preemptions > 0
    assert sched.counters.num_prefix_cache_hit_tokens > 0
    for request in requests:
        got = torch.stack(rows[request.seq_id])
        tokens = request.token_ids
        assert len(got) == num_out == len(tokens) - len(request.prompt_token_ids)
        start = len(request.prompt_token_ids) - 1
        want = hf_logits(tokens[:-1])[start:]
        assert rel_err(got, want) < TOLERANCE, request.request_id
        assert got.argmax(-1).tolist() == tokens[start + 1 :]


def script_blocks(engine: Engine) -> int:
    """The scheduler's blocks for the dense families' script: too few for all six requests at
    once (fewer where every layer is windowed: the scheduler then releases blocks out of the
    window)."""
    return 10 if engine.info.sliding_window else 20


@pytest.mark.parametrize("family", FAMILIES)
def test_scheduled_script_matches_hf(load: Any, family: str) -> None:
    m = load(family)
    check_script_matches_hf(m.engine, m.hf_logits, 6, NUM_OUT, script_blocks(m.engine))


def test_unserved_architecture_is_refused_naming_the_served(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    with pytest.raises(ModelSourceError) as err:
        load_model_config(tmp_path)
    message = str(err.value)
    assert "architectures=['FalconForCausalLM'] is not served" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in message


def _set_on_attention(name: str, value: Any) -> Callable[[Any], Callable[[], None]]:
    """A quirk switch: set `name` on every layer's attention (value(model) when callable);
    returns the undo."""

    def switch(model: Any) -> Callable[[], None]:
        attentions = [layer.self_attn for layer in model.layers]
        saved = [getattr(a, name) for a in attentions]
        for attention in attentions:
            setattr(attention, name, value(model) if callable(value) else value)

        def undo() -> None:
            for attention, old in zip(attentions, saved, strict=True):
                setattr(attention, name, old)

        return undo

    return switch


def _unscaled_rope(model: Any) -> Callable[[], None]:
    from llmserve.engine.model.rotary import rope_cos_sin_cache, rope_inv_freq

    config = dataclasses.replace(model.config, rope_scaling=None)
    rotary = model.rotary_emb
    saved = rotary.cos_sin_cache
    rotary.cos_sin_cache = rope_cos_sin_cache(rope_inv_freq(config), rotary.max_positions)
    return lambda: setattr(rotary, "cos_sin_cache", saved)


# A quirk of each family, switched off in the loaded model: the logits must then differ from
# HF's, or the comparisons above would not show that the quirk is implemented.
QUIRKS = {
    "mistral": _set_on_attention("window", None),
    "gemma2": _set_on_attention("softcap", None),
    "gemma2-window": _set_on_attention("window", None),
    "gemma3": _set_on_attention("rotary_emb", lambda model: model.rotary_emb),
    "gemma3-window": _set_on_attention("window", None),
    "phi3": _unscaled_rope,
    "phi3-window": _set_on_attention("window", None),
}


@pytest.mark.parametrize("quirk", QUIRKS)
def test_each_quirk_matters_for_these_prompts(load: Any, quirk: str) -> None:
    m = load(quirk.split("-")[0])
    tokens = prompt(45, seed=1)
    undo = QUIRKS[quirk](m.engine.model)
    try:
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    finally:
        undo()
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


# A GGUF has no query_pre_attn_scalar (llama.cpp scales by head_dim ** -0.5 but for Gemma's
# 27B models): the Gemma checkpoints written to GGUF use that scalar.
GGUF_OVERRIDES = {"gemma2": {"query_pre_attn_scalar": 32}, "gemma3": {"query_pre_attn_scalar": 32}}


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_hf(load: Any, family: str, tmp_path: Path) -> None:
    """The same checkpoint written as llama.cpp lays out that architecture (tests/family_gguf.py),
    loaded through our GGUF path: the same config, logits within 1e-4 of HF's at every position
    of a whole prompt, and the scheduled script (chunked prefills, prefix-cache hits,
    preemptions)."""
    from tests.family_gguf import write_family_gguf

    m = load(family, **GGUF_OVERRIDES.get(family, {}))
    path = write_family_gguf(m.path, tmp_path / f"{family}.gguf", family)
    from_hf, from_gguf = load_model_config(m.path), load_model_config(path)
    assert from_gguf.family == ("llama" if family == "mistral" else family)
    floats = ("rms_norm_eps", "attention_scale")
    for name in floats:
        want = getattr(from_hf, name)
        assert getattr(from_gguf, name) == (want and pytest.approx(want, rel=1e-6)), name
    same = ("name", "family", "eos_token_ids", "bos_token_id", "rope_scaling", *floats)
    assert dataclasses.replace(from_gguf, **{k: getattr(from_hf, k) for k in same}) == from_hf
    if from_hf.rope_scaling is not None:
        assert from_gguf.rope_scaling is not None
        assert from_gguf.rope_scaling["rope_type"] == from_hf.rope_scaling["rope_type"]
    engine = Engine(
        EngineConfig(
            model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE,
            **ENGINE_SETTINGS.get(family, {}),
        )
    )  # fmt: skip
    tokens = prompt(45, seed=1)
    want = m.hf_logits(tokens)
    (whole,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, want) < TOLERANCE
    engine.reset()
    check_script_matches_hf(engine, m.hf_logits, 6, NUM_OUT, script_blocks(engine))


def test_generation_defaults_fill_only_unset_fields(tmp_path: Path) -> None:
    from llmserve.common.model_config import generation_defaults
    from llmserve.common.sampling import normalized, with_defaults
    from llmserve.protos.common_pb2 import SamplingParams

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    )
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0}
    unset = normalized(with_defaults(SamplingParams(), defaults))
    assert (unset.top_p, unset.top_k) == (pytest.approx(0.95), 20)
    assert unset.temperature == pytest.approx(0.6)
    mine = normalized(with_defaults(SamplingParams(temperature=0.0, top_k=-1), defaults))
    assert (mine.temperature, mine.top_k, mine.top_p) == (0.0, -1, pytest.approx(0.95))


def test_blocks_out_of_the_window_are_released(load: Any) -> None:
    """Mistral (every layer windowed, 12 tokens, blocks of 8): one 120-token prompt, 40 tokens
    out, in 16-token steps. Releasing the blocks that fell out of the window, the request holds
    at most 4 blocks (the window's 2-3 and this step's), instead of 20 at the end; the logits
    are the same rows and within 1e-4 of HF's either way."""
    m = load("mistral")
    assert m.engine.info.sliding_window == 12
    greedy = sampling(temperature=0.0)
    runs = {}
    for release in (False, True):
        request = Request("long", 1, prompt(120, seed=7), greedy, 40, ignore_eos=True)  # type: ignore[arg-type]
        script = run_script(m.engine, [request], 64, release, max_num_batched_tokens=16)
        m.engine.reset()
        runs[release] = (script, request.token_ids)
    (held_all, tokens_all), (held_window, tokens_window) = [
        (max(runs[r][0].held), runs[r][1]) for r in (False, True)
    ]
    assert held_all == 20 and held_window == 4, (held_all, held_window)
    assert tokens_window == tokens_all
    got = torch.stack(runs[True][0].rows[1])
    assert torch.equal(got, torch.stack(runs[False][0].rows[1]))
    assert rel_err(got, m.hf_logits(tokens_all[:-1])[119:]) < TOLERANCE


def test_a_refused_feature_stops_the_engine_at_start(
    load: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family's record may refuse an engine feature; an engine asked for it refuses to start,
    naming the family, the feature and why, before loading any weight."""
    from llmserve.common.families import FAMILIES

    path = load("qwen2").path
    refusing = dataclasses.replace(FAMILIES["qwen2"], refuses={"tensor_parallel": "not yet"})
    monkeypatch.setitem(FAMILIES, "qwen2", refusing)
    config = EngineConfig(model=str(path), device="cpu", tensor_parallel_size=2)
    assert config.features() == ["tensor_parallel"]
    with pytest.raises(ModelSourceError, match=r"qwen2 \(Qwen2ForCausalLM\) does not support "):
        Engine(config)


def test_qwen3_8b_shape_has_its_published_size() -> None:
    """configs/qwen3-8b (for --load-format dummy, the GPU check's families stage): the model
    card's 8.2 B parameters, 6.95 B of them outside the embedding table and LM head."""
    import math

    from llmserve.engine.model.dummy import hf_tensor_shapes

    config = load_model_config(Path(__file__).parents[4] / "configs" / "qwen3-8b")
    assert config.family == "qwen3" and not config.tie_word_embeddings
    sizes = {n: math.prod(s) for n, s in hf_tensor_shapes(config).items()}
    total = sum(sizes.values())
    tables = sizes["model.embed_tokens.weight"] + sizes["lm_head.weight"]
    assert abs(total / 8.19e9 - 1) < 0.01 and abs((total - tables) / 6.95e9 - 1) < 0.01
