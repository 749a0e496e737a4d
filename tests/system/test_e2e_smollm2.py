"""The built-in model through the whole stack (three processes, real gRPC) against HF transformers
loading the same GGUF in float32: greedy output equal token for token; split across three
engine ranks (`llmserve serve --tensor-parallel-size 3 --device cpu`), the same tokens again; and
lm-eval's `local-completions` model scoring a multiple-choice task over HTTP (echo with
logprobs) with transformers' loglikelihoods."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from llmserve.client import Client, Completion, make_request
from llmserve.common.net import check_health
from tests.stack import ROOT, Stack, child_pid, free_port, serve_command, start_stack
from tests.system.test_stack_parallel import rank_pids

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

NEW_TOKENS = 32
HF_SCRIPT = ROOT / "scripts" / "make_hf_reference.py"
CHATS = [
    [("user", "What is the capital of France?")],
    [("user", "Write a haiku about the sea.")],
    [("system", "You are a terse assistant."), ("user", "List three prime numbers.")],
    [("user", "Explain what a GPU is in one sentence.")],
    [("user", "Translate 'good morning' into Spanish and German.")],
    [("user", "What is 17 * 23? Show your work.")],
    [("user", "Give me a name for a pet turtle 🐢.")],
    [("user", "hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a fun fact.")],
]


@pytest.fixture(scope="module")
def stack(builtin_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        None,
        engine_args=["--kv-cache-gb", "0.5"],
        http=True,  # lm-eval's local-completions
        log_dir=tmp_path_factory.mktemp("logs"),
        timeout=300,
    )
    yield s
    s.close()


def _reference_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_hf_reference", HF_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_reference(builtin_model_path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new ids) per chat, from transformers on the same GGUF in float32, as
    scripts/make_hf_reference.py stored them in tests/data (re-checked against transformers by
    `pytest --hf-reference -m hf_reference`). A file made for another model file, transformers
    version, chat list or token count fails here, naming the script that regenerates it."""
    script = _reference_script()
    stored = json.loads(script.REFERENCE_PATH.read_text())
    regenerate = f"regenerate it: python {HF_SCRIPT.relative_to(ROOT)}"
    key = script.reference_key(builtin_model_path)
    for field, value in key.items():
        if stored.get(field) != value:
            pytest.fail(
                f"{script.REFERENCE_PATH.name} is stale: {field} is {stored.get(field)!r} there "
                f"but {value!r} here; {regenerate}"
            )
    chats = [[tuple(turn) for turn in chat] for chat in stored["chats"]]
    if chats != CHATS or stored["new_tokens"] != NEW_TOKENS:
        pytest.fail(f"{script.REFERENCE_PATH.name} holds other chats or token counts; {regenerate}")
    return [(out["prompt_ids"], out["new_ids"]) for out in stored["outputs"]]


@pytest.mark.hf_reference
def test_stored_reference_is_what_transformers_makes(
    builtin_model_path: Path, hf_reference: list
) -> None:
    """Opt-in (a minute or two): transformers run again now gives the stored tokens."""
    fresh = _reference_script().generate(builtin_model_path, CHATS, NEW_TOKENS)
    assert [(out["prompt_ids"], out["new_ids"]) for out in fresh["outputs"]] == hf_reference


@pytest.fixture(scope="module")
def single_engine_results(stack: Stack) -> list[Completion]:
    """The stack's greedy completions of CHATS, all at once (one engine)."""
    requests = [
        make_request(messages=chat, max_tokens=NEW_TOKENS, temperature=0.0) for chat in CHATS
    ]
    with stack.client() as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(client.generate, requests))


def test_greedy_matches_transformers(
    stack: Stack, single_engine_results: list[Completion], hf_reference: list
) -> None:
    results = single_engine_results
    for chat, result, (prompt_ids, expected) in zip(CHATS, results, hf_reference, strict=True):
        assert result.prompt_tokens == len(prompt_ids), chat
        assert result.token_ids == expected, chat
        assert result.finish_reason == ("stop" if expected[-1] == 2 else "length")
    stack.assert_idle()


def test_tensor_parallel_3_gives_the_same_tokens(
    single_engine_results: list[Completion], hf_reference: list, tmp_path: Path
) -> None:
    """SmolLM2 (9 query heads, 3 KV heads) over three engine ranks, started as a user starts it:
    the same greedy tokens as one engine (and so as transformers) for concurrent chats."""
    requests = [
        make_request(messages=chat, max_tokens=NEW_TOKENS, temperature=0.0) for chat in CHATS
    ]
    expected = single_engine_results
    ports = [free_port(), free_port(), free_port()]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(
            serve_command(ports, "--tensor-parallel-size", "3", "--device", "cpu",
                          "--kv-cache-gb", "0.25"),
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        address = f"127.0.0.1:{ports[0]}"
        deadline = time.monotonic() + 300
        while check_health(address, timeout=1.0) != "SERVING":
            if serve.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        assert len(rank_pids(child_pid(serve.pid, "engine"))) == 2  # ranks 1 and 2
        with Client(address) as client, ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(client.generate, requests))
        for chat, want, got, (_, hf) in zip(CHATS, expected, results, hf_reference, strict=True):
            assert got.token_ids == want.token_ids == hf, chat
            assert got.text == want.text
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


# -- lm-eval ----------------------------------------------------------------------------------

TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: "{delimiter}"
metric_list:
  - metric: acc
"""


def _hf_tokenizer_dir(model_path: Path, directory: Path) -> Path:
    """The served tokenizer (common/tokenizer_files.py, read from the GGUF) as an HF tokenizer
    directory, for lm-eval's tokenizer_backend=huggingface: the same ids as the server's."""
    from llmserve.common.tokenizer_files import load_tokenizer_files

    files = load_tokenizer_files(model_path)
    files.tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": files.bos_token,
              "eos_token": files.eos_token, "add_bos_token": False}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_lm_eval_scores_a_multiple_choice_task_as_transformers(
    stack: Stack, builtin_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's local-completions model (echo + logprobs + max_tokens 1 on /v1/completions,
    token-id prompts) runs a 4-doc multiple-choice task written here with local data: every
    choice's loglikelihood equals transformers' (tests/data/hf_prompt_logprobs_smollm2.json) and
    so does the accuracy."""
    # datasets reads these at import: no hub, its cache under tmp_path
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from tests.engine.test_prompt_logprobs import TOLERANCE, hf_prompt_logprobs

    reference = hf_prompt_logprobs(builtin_model_path)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in reference["docs"]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = TASK_YAML.format(data=data, delimiter=reference["target_delimiter"])
    (tasks / "tiny_mc.yaml").write_text(yaml)
    tokenizer = _hf_tokenizer_dir(builtin_model_path, tmp_path)
    assert stack.http_url is not None
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "smollm2",
            "base_url": f"{stack.http_url}/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["tiny_mc"],
        # only this task: indexing lm-eval's own thousands of task files took 47 s here
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
    )
    assert results is not None
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    served = [resp[0] for sample in samples for resp in sample["resps"]]
    expected = reference["loglikelihoods"]
    assert len(served) == len(expected) == 12
    for (logprob, is_greedy), want in zip(served, expected, strict=True):
        num_tokens = len(want["continuation_ids"])
        assert float(logprob) == pytest.approx(want["logprob"], abs=TOLERANCE * num_tokens)
        assert is_greedy == want["is_greedy"]
    choices = [len(doc["choices"]) for doc in reference["docs"]]
    starts = [sum(choices[:i]) for i in range(len(choices))]
    picks = [
        max(range(n), key=lambda c, s=s: expected[s + c]["logprob"])
        for n, s in zip(choices, starts, strict=True)
    ]
    want_acc = sum(p == doc["answer"] for p, doc in zip(picks, reference["docs"], strict=True))
    assert results["results"]["tiny_mc"]["acc,none"] == want_acc / len(picks)
    stack.assert_idle()
