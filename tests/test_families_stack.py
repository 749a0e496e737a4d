"""One non-Llama family through the whole stack: `llmserve serve --model DIR` on a tiny random
Gemma 2 (soft-caps, sliding window, sandwich norms): greedy tokens identical to transformers',
the model's generation_config.json sampling defaults applied to a request that leaves them
unset, and every EOS id the model declares stopping generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from llmserve.client import Client, make_request
from tests.family_models import load_hf, make_tiny_family
from tests.stack import ROOT, free_port, serve_command

NUM_OUT = 12


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


def test_gemma2_served_greedy_matches_transformers(tmp_path: Path) -> None:
    # Untied, with Gemma 2's own caps: the tiny tied model repeats one token greedily.
    model_dir = make_tiny_family(
        tmp_path / "gemma2", "gemma2", tie_word_embeddings=False,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )  # fmt: skip
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = list(prompt.encode())  # the byte tokenizer: one token per byte, no BOS
    expected = hf_greedy(model_dir, ids)
    assert len(expected) == NUM_OUT
    # A second EOS id, declared only in generation_config.json: the first new token greedy
    # decoding reaches after a few steps. Temperature 0 there makes unset requests greedy.
    stop_at = next(i for i in range(4, NUM_OUT) if expected[i] not in expected[:i])
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen_path.write_text(
        json.dumps({**gen, "eos_token_id": [258, expected[stop_at]], "temperature": 0.0})
    )
    ports = [free_port() for _ in range(3)]
    serve = subprocess.Popen(
        serve_command(ports, "--model", str(model_dir), "--num-kv-blocks", "64"),
        cwd=ROOT,
        env={**os.environ, "LLMSERVE_INTERNAL_TOKEN": "families-test"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert "llmserve ready" in line, line
        with Client(f"127.0.0.1:{ports[0]}") as client:
            # No temperature: the model's default (0.0) applies; ignore_eos: all NUM_OUT tokens.
            whole = client.generate(make_request(text=prompt, max_tokens=NUM_OUT, ignore_eos=True))
            stopped = client.generate(make_request(text=prompt, max_tokens=NUM_OUT))
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    assert whole.token_ids == expected
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == expected[: stop_at + 1]


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
