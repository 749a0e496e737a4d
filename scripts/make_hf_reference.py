"""Write tests/data/hf_reference_smollm2.json: the greedy tokens HF transformers makes from the
built-in model (the GGUF loaded in float32) for the chats of tests/system/test_e2e_smollm2.py, which
the stack's output must equal token for token.

    python scripts/make_hf_reference.py          # regenerate the file (a minute or two)
    python scripts/make_hf_reference.py --check  # compare in memory; exit 1 if it differs

The file is keyed by the model file's sha256 and the transformers version: the test fails, naming
this script, when either no longer matches (a new model pin or a transformers upgrade), and
`pytest --hf-reference -m hf_reference` re-runs transformers and compares it with the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REFERENCE_PATH = ROOT / "tests" / "data" / "hf_reference_smollm2.json"
EOS_TOKEN_ID = 2


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def reference_key(model_path: Path) -> dict[str, str]:
    """What the reference depends on besides the chats: the model's bytes and transformers."""
    return {
        "model_file": model_path.name,
        "model_sha256": file_sha256(model_path),
        "transformers_version": metadata.version("transformers"),
    }


def generate(
    model_path: Path, chats: list[list[tuple[str, str]]], new_tokens: int
) -> dict[str, Any]:
    """The reference document: its key, the chats and, per chat, the prompt ids and the greedy
    new ids from transformers on the GGUF in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(model_path.parent), model_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    outputs = []
    for chat in chats:
        messages = [{"role": r, "content": c} for r, c in chat]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=EOS_TOKEN_ID,
                pad_token_id=EOS_TOKEN_ID,
            )
        outputs.append({"prompt_ids": list(ids), "new_ids": generated[0, len(ids) :].tolist()})
    return {
        **reference_key(model_path),
        "new_tokens": new_tokens,
        "chats": [[list(turn) for turn in chat] for chat in chats],
        "outputs": outputs,
    }


def dump(document: dict[str, Any]) -> str:
    """JSON with one line per field, and one per chat and per output (diffs stay readable)."""

    def line(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    fields = []
    for key, value in document.items():
        if isinstance(value, list):
            items = ",\n".join(f"  {line(item)}" for item in value)
            fields.append(f" {line(key)}: [\n{items}\n ]")
        else:
            fields.append(f" {line(key)}: {line(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the file; write nothing")
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH)
    args = parser.parse_args()
    from llmserve.common.model_config import builtin_model_path
    from tests.system.test_e2e_smollm2 import CHATS, NEW_TOKENS

    document = generate(builtin_model_path(), CHATS, NEW_TOKENS)
    text = dump(document)
    if args.check:
        same = args.out.exists() and json.loads(args.out.read_text()) == document
        print(f"{args.out}: {'current' if same else 'differs from transformers: regenerate'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
