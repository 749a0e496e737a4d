"""Write a draft model for `--speculative-method draft --speculative-model PATH` cut from a Llama
GGUF (default: the built-in SmolLM2-135M-Instruct): some of its layers, then its final norm and
LM head, its embeddings and tokenizer unchanged, every tensor's bytes copied as stored (a Q4_1
layer stays Q4_1, so the engine loads it as it loads the target).

    python scripts/make_draft_model.py OUT.gguf [--num-layers 10] [--keep-last 0] [--model PATH]

The draft keeps the first num-layers - keep-last layers and the last keep-last ones, renumbered
0 .. num-layers - 1. It is not a trained small model: the layers were trained to feed the layers
after them, not the LM head, so expect few accepted proposals (docs/speculative-decoding.md).
There is no smaller SmolLM2 with the same tokenizer on this machine and nothing is downloaded;
a real draft (a smaller model of the same family and tokenizer) is passed as is. The file is
generated, not committed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmserve.common.model_config import resolve_model_path  # noqa: E402

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def kept_layers(num_layers: int, total: int, keep_last: int) -> list[int]:
    """The source layers the draft keeps, in order: the first num_layers - keep_last, then the
    last keep_last."""
    if not 0 < num_layers <= total or not 0 <= keep_last <= num_layers:
        raise ValueError(
            f"num_layers={num_layers}, keep_last={keep_last}: need 0 < num_layers <= {total} "
            f"(the model's layers) and 0 <= keep_last <= num_layers"
        )
    return list(range(num_layers - keep_last)) + list(range(total - keep_last, total))


def make_draft(source: Path, out: Path, num_layers: int, keep_last: int = 0) -> list[int]:
    """Write the draft GGUF to out; the source layers it holds."""
    import gguf

    reader = gguf.GGUFReader(source)
    total = int(reader.fields["llama.block_count"].contents())
    layers = kept_layers(num_layers, total, keep_last)
    renumber = {old: new for new, old in enumerate(layers)}
    writer = gguf.GGUFWriter(out, arch="llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = field.contents()
        if field.name == "llama.block_count":
            value = len(layers)
        elif field.name == "general.name":
            value = f"{value} draft (layers {layers[0]}-{layers[-1]} of {total}, {len(layers)})"
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    tensors = []
    for tensor in reader.tensors:
        m = _LAYER.fullmatch(tensor.name)
        if m is None:
            tensors.append((tensor.name, tensor))
        elif int(m.group(1)) in renumber:
            tensors.append((f"blk.{renumber[int(m.group(1))]}.{m.group(2)}", tensor))
    for name, tensor in tensors:
        data = tensor.data
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the draft GGUF to write")
    p.add_argument("--model", default=None, help="the source GGUF (default: the built-in model)")
    p.add_argument("--num-layers", type=int, default=10, help="the draft's layers")
    p.add_argument(
        "--keep-last", type=int, default=0, help="how many of them are the source's last layers"
    )
    args = p.parse_args()
    source = resolve_model_path(args.model)
    if source.is_dir():
        p.error(f"--model {source}: a GGUF file is needed")
    layers = make_draft(source, args.out, args.num_layers, args.keep_last)
    print(f"wrote {args.out}: layers {layers} of {source.name}")


if __name__ == "__main__":
    main()
