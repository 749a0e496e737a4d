"""Quantized checkpoints as they ship: the format config.json's `quantization_config` declares
(engine/model/checkpoint_schemes.py), checked against the checkpoint's tensors before any is loaded,
and the checkpoint seen as the float model's tensors (`CheckpointView`). weights.py's
safetensors loader goes through here.

The rule: no tensor of a checkpoint is ever silently ignored. A method or option the schemes do
not read, a tensor whose name or dtype the declared scheme does not explain (a scale with no
declared format, a float8 or integer weight with no scale), or, after a whole model's load, a
tensor no layer asked for: each stops the start, naming it.

On a CPU, W4A16, W8A16 and FP8 linear weights are kept as stored (`CheckpointView.kept`,
engine/model/checkpoint_linear.py, kernels/cpu_wq.cpp); every other weight, and every weight on
a GPU, is dequantized at load to float32 and then held as the model's dtype (or, with
--quantization int8, re-held in the int8 layers). Either way the served model computes the
checkpoint's dequantized float model. Activation scales a checkpoint carries (FP8 W8A8's
input_scale) are read and recorded, not emulated. docs/quantization.md, "Checkpoint formats",
has the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from llmserve.common.log import get_logger
from llmserve.common.model_config import ModelSourceError
from llmserve.engine.model.checkpoint_dequant import dequantize_fp8_block
from llmserve.engine.model.checkpoint_schemes import (
    SUPPORTED,
    Unquantized,
    WeightScheme,
    read_scheme,
)
from llmserve.engine.model.kept_weights import KeptWeight

log = get_logger(__name__)

__all__ = ["CheckpointView", "checkpoint_weights", "dequantize_fp8_block", "read_format"]

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Tensors a checkpoint may hold that the model recomputes (old transformers saved the rotary
# frequencies with each layer): read and dropped, on purpose.
RECOMPUTED = ("rotary_emb.inv_freq",)
# Leaf-name parts of quantization formats' companion tensors (FP8's weight_scale_inv, GPTQ's
# qweight / qzeros / scales / g_idx, AWQ's, compressed-tensors' weight_packed / zero_point).
QUANT_LEAVES = ("scale", "qweight", "qzeros", "zero_point", "g_idx", "packed", "blocks")


def read_format(path: Path) -> WeightScheme:
    """The scheme config.json's quantization_config declares (Unquantized without one); raises
    ModelSourceError naming the method or option the loader does not read."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return Unquantized()
    qc = json.loads(config_file.read_text()).get("quantization_config")
    return Unquantized() if qc is None else read_scheme(path, qc)


def quantized_stems(fmt: WeightScheme, dtypes: Mapping[str, str]) -> dict[str, str]:
    """stem -> the stored name of its quantized weight (a name ending in one of fmt's primary
    suffixes, of one of that suffix's dtypes)."""
    stems: dict[str, str] = {}
    for name, dtype in dtypes.items():
        for suffix, kinds in fmt.primaries.items():
            if name.endswith(suffix) and dtype in kinds:
                stems[name.removesuffix(suffix)] = name
    return stems


def _companion_stem(fmt: WeightScheme, name: str) -> str | None:
    for suffix in fmt.companions:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def check_tensors(path: Path, fmt: WeightScheme, dtypes: Mapping[str, str]) -> None:
    """Raise ModelSourceError, naming them, for tensors `fmt` does not explain: a quantized
    weight without its required companions, a companion with no quantized weight, a weight
    whose dtype (safetensors' name: F32, F8_E4M3, I32...) is not float and is not fmt's, or
    another tensor named as a quantization format's companions are.
    dtypes: every tensor's safetensors dtype by name."""
    stems = quantized_stems(fmt, dtypes)
    primaries = set(stems.values())
    unread: list[str] = []
    for name, dtype in dtypes.items():
        leaf = name.rpartition(".")[2]
        if name.endswith(RECOMPUTED) or (leaf == "bias" and dtype in FLOAT_DTYPES):
            continue
        if name in primaries:
            owner = next(s for s, n in stems.items() if n == name)
            ok = all(owner + suffix in dtypes for suffix in fmt.required)
        elif (owner_stem := _companion_stem(fmt, name)) is not None:
            ok = owner_stem in stems
        elif leaf == "weight":
            ok = dtype in FLOAT_DTYPES
        else:
            # Another float parameter (a router's e_score_correction_bias) is the model's own:
            # whether a layer reads it is checked after the load (check_all_read). A name a
            # quantization format gives its companions is not, with no format declared.
            ok = dtype in FLOAT_DTYPES and not any(part in leaf for part in QUANT_LEAVES)
        if not ok:
            unread.append(f"{name} ({dtype})")
    if unread:
        raise ModelSourceError(
            f"{path}: quantization {fmt.describe()!r} (from config.json) does not read "
            f"{len(unread)} of the checkpoint's tensors, e.g. {unread[:4]}; "
            f"supported formats: {SUPPORTED}"
        )


class CheckpointView(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as the float model's: each quantized weight comes back under its
    float name (`fmt.presented`), dequantized to float32 (its stored tensors and companions
    hidden); every other tensor as stored. Records each stored name it reads in `read_names`."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], fmt: WeightScheme, dtypes: Mapping[str, str]
    ):
        self.weights = weights
        self.fmt = fmt
        stems = quantized_stems(fmt, dtypes)
        self.quantized = {fmt.presented(stem): stem for stem in stems}
        hidden = set(stems.values()) | {
            n for n in weights if (owner := _companion_stem(fmt, n)) is not None and owner in stems
        }
        self.names = [n for n in weights if n not in hidden] + list(self.quantized)
        self.known = set(self.names)
        self.read_names: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        stem = self.quantized.get(name)
        if stem is None:
            self.read_names.add(name)
            return self.weights[name]
        return self.fmt.dequantize(stem, lambda suffix: self._stored(stem + suffix))

    def kept(self, name: str) -> KeptWeight | None:
        """The quantized weight presented as `name`, as stored, for the CPU kernels (None: a
        float tensor, or one its scheme does not keep: read it dequantized)."""
        stem = self.quantized.get(name)
        if stem is None:
            return None
        return self.fmt.kept(stem, lambda suffix: self._stored(stem + suffix))

    def kept_stack(self, name: str) -> list[KeptWeight] | None:
        """The stacked (fused experts') quantized weight presented as `name`, one KeptWeight
        per expert, as stored (None: a float tensor, or one its scheme does not keep)."""
        stem = self.quantized.get(name)
        if stem is None:
            return None
        return self.fmt.kept_stack(stem, lambda suffix: self._stored(stem + suffix))

    def _stored(self, name: str) -> torch.Tensor | None:
        if name not in self.weights:
            return None
        self.read_names.add(name)
        return self.weights[name]

    def __contains__(self, name: object) -> bool:
        return name in self.known

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def check_all_read(self, path: Path, tied_head: bool) -> None:
        """After a whole model's load: raise ModelSourceError naming the tensors no layer asked
        for (a tied model's stored `lm_head.weight`, a copy of the embeddings, excepted)."""
        unread = [
            n
            for n in self.weights
            if n not in self.read_names
            and not n.endswith(RECOMPUTED)
            and not (tied_head and n == "lm_head.weight")
        ]
        if unread:
            raise ModelSourceError(
                f"{path}: {len(unread)} of the checkpoint's tensors are used by no layer of "
                f"this model, e.g. {sorted(unread)[:4]}; refusing to serve it without them"
            )


def checkpoint_weights(
    path: Path, weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, str]
) -> CheckpointView:
    """`weights` (a safetensors directory's, by name) seen through the format its config.json
    declares, once check_tensors has found every tensor explained; logs the format."""
    fmt = read_format(path)
    check_tensors(path, fmt, dtypes)
    if fmt.describe() != "none":
        log.info("checkpoint quantization", model=str(path), quantization=fmt.describe())
    return CheckpointView(weights, fmt, dtypes)


def checkpoint_format(path: Path, kept: str = "") -> str:
    """What the engine's start line names: the checkpoint's quantization format ("none" for a
    float checkpoint or a GGUF file, whose blocks --quantization describes) and how it is held:
    `kept` (engine/model/checkpoint_linear.py's kept_description) or dequantized at load."""
    described = read_format(path).describe()
    if described == "none":
        return described
    held = f"{kept}, the rest dequantized at load" if kept else "dequantized at load"
    return f"{described}, {held}"
