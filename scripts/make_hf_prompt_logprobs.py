"""Write tests/data/hf_prompt_logprobs_smollm2.json: what HF transformers gives as the prompt
logprobs of the built-in model (the GGUF loaded in float32), which the served prompt logprobs
must equal (tests/engine/test_prompt_logprobs.py, tests/system/test_lm_eval.py):

- `prompts`: a few texts, their token ids, and per token after the first its logprob
  (log_softmax of the logits at the position before it) and the TOP most likely tokens there;
- `docs` / `loglikelihoods`: a tiny multiple-choice task (the lm-eval test writes it as a task
  file with local data) and, per (doc, choice), the context and continuation ids as lm-eval's
  API models split them (`_encode_pair`: a context's trailing space moves to the continuation;
  continuation = encode(context + continuation) after encode(context)), the continuation's
  summed logprob and whether each of its tokens is the argmax.

    python scripts/make_hf_prompt_logprobs.py          # regenerate (a minute or two)
    python scripts/make_hf_prompt_logprobs.py --check  # compare in memory; exit 1 if it differs

Keyed like scripts/make_hf_reference.py's file (model sha256, transformers version).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REFERENCE_PATH = ROOT / "tests" / "data" / "hf_prompt_logprobs_smollm2.json"
TOP = 5
PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Rivers run into the "
    "sea; mountains rise above the clouds, and the sea is blue on a clear summer day.",
    "Once upon a time",
]
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["blue", "cold", "fast"], "answer": 1},
    {"question": "Two plus two equals", "choices": ["seven", "three", "four"], "answer": 2},
    {"question": "Water freezes into", "choices": ["ice", "fire", "sand"], "answer": 0},
]
TARGET_DELIMITER = " "


def _make_hf_reference() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_hf_reference", ROOT / "scripts" / "make_hf_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode_pair(encode: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair: (context ids, continuation ids)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]


def generate(model_path: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(model_path.parent), model_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def scores(ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, vocab]: row j holds the logprobs of the token after position j."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        return torch.log_softmax(logits, dim=-1)

    prompts = []
    for text in PROMPTS:
        ids = encode(text)
        lps = scores(ids)
        top = lps.topk(TOP, dim=-1)
        prompts.append({
            "text": text,
            "ids": ids,
            "logprobs": lps.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(),
            "top_ids": top.indices.tolist(),
            "top_logprobs": top.values.tolist(),
        })  # fmt: skip
    loglikelihoods = []
    for doc in DOCS:
        for choice in doc["choices"]:
            context_ids, continuation_ids = encode_pair(
                encode, doc["question"], TARGET_DELIMITER + choice
            )
            ids = context_ids + continuation_ids
            lps = scores(ids)[len(context_ids) - 1 :]
            target = torch.tensor(continuation_ids)[:, None]
            loglikelihoods.append({
                "context_ids": context_ids,
                "continuation_ids": continuation_ids,
                "logprob": float(lps.gather(1, target).sum()),
                "is_greedy": bool((lps.argmax(dim=-1) == target[:, 0]).all()),
            })  # fmt: skip
    return {
        **_make_hf_reference().reference_key(model_path),
        "top": TOP,
        "prompts": prompts,
        "docs": DOCS,
        "target_delimiter": TARGET_DELIMITER,
        "loglikelihoods": loglikelihoods,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the file; write nothing")
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH)
    args = parser.parse_args()
    from llmserve.common.model_config import builtin_model_path

    document = generate(builtin_model_path())
    if args.check:
        stored = json.loads(args.out.read_text()) if args.out.exists() else None
        same = stored == json.loads(json.dumps(document))
        print(f"{args.out}: {'current' if same else 'differs from transformers: regenerate'}")
        return 0 if same else 1
    args.out.write_text(_make_hf_reference().dump(document))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
