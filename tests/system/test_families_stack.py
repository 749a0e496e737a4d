"""The families through the whole stack, `llmserve serve --model DIR|FILE` on tiny random
checkpoints: greedy tokens identical to transformers', the model's sampling defaults
(generation_config.json) applied to a request that leaves them unset, and a second end token the
model declares (generation_config.json's list, a GGUF's eot id) stopping generation.

Each stack costs ~5 s of CPU, so the suite serves two: Gemma 2 from an HF directory (soft-caps,
sliding window, sandwich norms) and Qwen3-MoE from a GGUF (experts, qk-norm, the tokenizer and
chat template read from the file). `pytest --family-stacks -m family_stacks` serves every other
family from both formats, SmolLM3, DeepSeek-V3 and gpt-oss from an HF directory only
(24 stacks in all; docs/models.md gives the last run's time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.client import Client, Completion, make_request
from tests.engine.model.families.test_families import GGUF_OVERRIDES
from tests.factories import EOS_TOKEN_ID
from tests.family_gguf import write_family_gguf
from tests.family_models import ENGINE_SETTINGS, FAMILY_CONFIGS, load_hf, make_tiny_family
from tests.glm4_moe_gguf import write_glm4_moe_gguf
from tests.moe_models import MOE_CONFIGS, make_tiny_moe, write_moe_gguf
from tests.qwen3_next_gguf import write_qwen3_next_gguf
from tests.stack import ROOT, free_port, serve_command

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

NUM_OUT = 12
PROMPT = "the quick brown fox jumps over the lazy dog"
IDS = list(PROMPT.encode())  # the byte tokenizer: one token per byte, no BOS
# Untied Gemma 2 with its own caps: the tiny tied model repeats one token greedily.
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma2": {
        "tie_word_embeddings": False,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
}
MAKERS: dict[str, Callable[..., Path]] = {
    **{f: make_tiny_family for f in FAMILY_CONFIGS},
    **{f: make_tiny_moe for f in MOE_CONFIGS},
}
IN_SUITE = [("gemma2", "hf"), ("qwen3_moe", "gguf")]
OPT_IN = [(f, fmt) for f in MAKERS for fmt in ("hf", "gguf") if (f, fmt) not in IN_SUITE]
# Families served from an HF directory only (no GGUF writer in the tests).
MAKERS.update(
    smollm3=make_tiny_family, glm4_moe=make_tiny_moe, deepseek_v3=make_tiny_moe,
    gpt_oss=make_tiny_moe, qwen3_next=make_tiny_moe,
)  # fmt: skip
OPT_IN += [("smollm3", "hf"), ("glm4_moe", "hf"), ("deepseek_v3", "hf"), ("gpt_oss", "hf")]
OPT_IN += [("qwen3_next", "hf")]  # served with its state slots, the prefix cache off
OPT_IN += [("qwen3_next", "gguf")]  # tests/qwen3_next_gguf writes it
OPT_IN += [("glm4_moe", "gguf")]  # tests/glm4_moe_gguf writes it


def make_qwen3_5_moe(directory: Path, family: str, **_: Any) -> Path:
    """Qwen3.5-MoE's tiny model (tests/engine/model/families/test_qwen3_5.py)."""
    from tests.engine.model.families.test_qwen3_5 import make_qwen3_5

    make_qwen3_5(directory, moe=True, seed=7)
    return directory


MAKERS["qwen3_5"] = make_qwen3_5_moe
OPT_IN += [("qwen3_5", "hf"), ("qwen3_5", "gguf")]  # the GGUF: `qwen35moe`


@torch.no_grad()
def hf_greedy(model_dir: Path, token_ids: list[int]) -> list[int]:
    hf = load_hf(model_dir)
    hf.generation_config.eos_token_id = None
    hf.generation_config.temperature = None
    hf.generation_config.top_k = None
    out = hf.generate(
        torch.tensor([token_ids]),
        attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=NUM_OUT,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()


def serve(model: Path, requests: list[Any], *flags: str) -> list[Completion]:
    """`llmserve serve --model model` on free ports; the completions of requests, in turn."""
    ports = [free_port() for _ in range(3)]
    process = subprocess.Popen(
        serve_command(ports, "--model", str(model), "--num-kv-blocks", "64", *flags),
        cwd=ROOT,
        env={**os.environ, "LLMSERVE_INTERNAL_TOKEN": "families-test"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "llmserve ready" in line, line
        with Client(f"127.0.0.1:{ports[0]}") as client:
            return [client.generate(request) for request in requests]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def check_served(tmp_path: Path, family: str, fmt: str) -> list[Completion]:
    """family's tiny model served from fmt ("hf" or "gguf"): HF's greedy tokens, whole; the
    request stopped by a second end token the model declares (the last token of HF's greedy
    output not seen before in it, and before its EOS). The HF directory's
    generation_config.json also sets temperature 0, so its requests leave temperature unset; a
    GGUF has no defaults, so its requests say 0. Returns the further completions (a GGUF's: a
    chat request and its rendered text) for the caller's checks."""
    gguf = GGUF_OVERRIDES.get(family, {}) if fmt == "gguf" else {}
    model_dir = MAKERS[family](tmp_path / family, family, **{**OVERRIDES.get(family, {}), **gguf})
    expected = hf_greedy(model_dir, IDS)
    assert len(expected) == NUM_OUT
    # Before the byte tokenizer's own EOS (258), should greedy decoding reach it.
    before_eos = expected.index(EOS_TOKEN_ID) if EOS_TOKEN_ID in expected else NUM_OUT
    stop_at = max(i for i in range(before_eos) if expected[i] not in expected[:i])
    temperature = None
    if fmt == "hf":
        model = model_dir
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text())
        eos = [EOS_TOKEN_ID, expected[stop_at]]
        gen_path.write_text(json.dumps({**gen, "eos_token_id": eos, "temperature": 0.0}))
    else:
        write = write_moe_gguf if family in MOE_CONFIGS else write_family_gguf
        write = write_qwen3_next_gguf if family in ("qwen3_next", "qwen3_5") else write
        write = write_glm4_moe_gguf if family == "glm4_moe" else write
        path = tmp_path / f"{family}.gguf"
        model = write(model_dir, path, family, eot_token_id=expected[stop_at])
        temperature = 0.0
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_SETTINGS.get(family, {}).items()]
    # ignore_eos: all NUM_OUT tokens; then the same request stopped by the declared end token.
    whole, stopped, *extra = serve(
        model,
        [
            make_request(text=PROMPT, max_tokens=NUM_OUT, ignore_eos=True, temperature=temperature),
            make_request(text=PROMPT, max_tokens=NUM_OUT, temperature=temperature),
            *[
                make_request(messages=[("user", PROMPT)], max_tokens=4, temperature=0.0),
                make_request(text=CHAT_RENDERED, max_tokens=4, temperature=0.0),
            ][: 2 if fmt == "gguf" else 0],
        ],
        *flags,
    )
    assert whole.token_ids == expected, (family, fmt)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == expected[: stop_at + 1]
    return extra


# The byte tokenizer's chat template (llmserve/bench/byte_tokenizer.py) on one user turn.
CHAT_RENDERED = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"


def test_gemma2_served_from_hf_directory(tmp_path: Path) -> None:
    check_served(tmp_path, "gemma2", "hf")


def test_qwen3_moe_served_from_gguf(tmp_path: Path) -> None:
    """Also the GGUF's chat template: a chat request gets the tokens of its rendered text."""
    chat, text = check_served(tmp_path, "qwen3_moe", "gguf")
    specials = ("<|im_start|>", "<|im_end|>", "<|im_start|>")  # one token each
    num_tokens = len(CHAT_RENDERED.encode()) - sum(len(s) - 1 for s in specials)
    assert chat.prompt_tokens == text.prompt_tokens == num_tokens
    assert chat.token_ids == text.token_ids and len(chat.token_ids) == 4


@pytest.mark.family_stacks
@pytest.mark.parametrize(("family", "fmt"), OPT_IN)
def test_every_family_served(tmp_path: Path, family: str, fmt: str) -> None:
    check_served(tmp_path, family, fmt)


@pytest.mark.parametrize("family", ["qwen3"])
def test_unserved_architecture_refused_at_serve(tmp_path: Path, family: str) -> None:
    """`llmserve serve` on an architecture no family serves exits 2 before starting anything,
    naming it and the served ones."""
    model_dir = make_tiny_family(tmp_path / family, family)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["OlmoForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run(
        [*serve_command([free_port() for _ in range(3)], "--model", str(model_dir))],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "architectures=['OlmoForCausalLM'] is not served" in out.stderr
    assert "Gemma2ForCausalLM" in out.stderr and "Qwen3ForCausalLM" in out.stderr


def test_gguf_of_an_unbuilt_tokenizer_refused_at_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF whose tokenizer we do not build (here WordPiece, llama.cpp's "bert") is refused by
    `llmserve serve` before anything starts, naming the tokenizer model, those we build, and
    the way out (the model's HF directory)."""
    import tests.family_gguf
    from llmserve.cli import main

    def wordpiece(w: Any, eot_token_id: int | None = None) -> None:
        w.add_tokenizer_model("bert")

    monkeypatch.setattr(tests.family_gguf, "add_byte_tokenizer", wordpiece)
    model_dir = make_tiny_family(tmp_path / "gemma2", "gemma2")
    path = write_family_gguf(model_dir, tmp_path / "gemma2.gguf", "gemma2")
    assert main(["serve", "--model", str(path), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "GGUF tokenizer model 'bert' is not supported" in err
    assert "SentencePiece, 'llama'" in err and "HF directory" in err
