"""Quantized checkpoints as they ship: the format config.json's `quantization_config` declares,
checked against the checkpoint's tensors before any is loaded, and the checkpoint seen as the
float model's tensors (`CheckpointView`). weights.py's safetensors loader goes through here.

The rule: no tensor of a checkpoint is ever silently ignored. A method or option this module
does not read, a tensor whose name or dtype no format here explains (a scale with no declared
format, a float8 or integer weight with no scale), or, after a whole model's load, a tensor no
layer asked for: each stops the start, naming it.

Read today (docs/quantization.md, "Checkpoint formats"):
- `quant_method: fp8` with `weight_block_size: [bn, bk]` (DeepSeek-V3's and Qwen3's FP8 releases,
  transformers' FineGrainedFP8): float8_e4m3fn weights [N, K] and float32 `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)], w = q * scale_inv of its block. Dequantized at load to the
  compute dtype: the served model is the dequantized float model (no activation quantization;
  `activation_scheme: dynamic` is the only scheme accepted, and is recorded, not emulated).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.common.log import get_logger
from llmserve.common.model_config import ModelSourceError

log = get_logger(__name__)

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Tensors a checkpoint may hold that the model recomputes (old transformers saved the rotary
# frequencies with each layer): read and dropped, on purpose.
RECOMPUTED = ("rotary_emb.inv_freq",)
SUPPORTED = "fp8 (weight_block_size, activation_scheme dynamic)"


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint's tensors hold. method: "none" (float tensors only) or "fp8-block";
    block: (rows, columns) of weights per scale for fp8-block."""

    method: str = "none"
    block: tuple[int, int] | None = None

    @property
    def companions(self) -> tuple[str, ...]:
        """Leaf names of the tensors that travel with a quantized `weight`."""
        return ("weight_scale_inv",) if self.method == "fp8-block" else ()

    def describe(self) -> str:
        if self.method == "none":
            return "none"
        return f"{self.method} {list(self.block or ())}, dequantized at load"


def read_format(path: Path) -> CheckpointFormat:
    """The format config.json's quantization_config declares (none without one); raises
    ModelSourceError naming the method or option this loader does not read."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return CheckpointFormat()
    qc = json.loads(config_file.read_text()).get("quantization_config")
    if qc is None:
        return CheckpointFormat()
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise ModelSourceError(
            f"{path}: config.json quantization_config.quant_method={method!r} is not supported "
            f"(supported: {SUPPORTED}); refusing to serve it rather than ignore its tensors"
        )
    return _fp8_format(path, qc)


def _fp8_format(path: Path, qc: dict[str, object]) -> CheckpointFormat:
    block = qc.get("weight_block_size")
    where = f"{path}: config.json quantization_config"
    if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
        raise ModelSourceError(
            f"{where}.weight_block_size={block!r}: fp8 is read block-scaled only, with two "
            f"positive block sizes (supported: {SUPPORTED})"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelSourceError(
            f"{where}.activation_scheme={scheme!r} is not supported (supported: 'dynamic')"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelSourceError(f"{where}.fmt={fmt!r} is not supported (supported: 'e4m3')")
    return CheckpointFormat("fp8-block", (int(block[0]), int(block[1])))


def _positive(value: object) -> bool:
    return isinstance(value, int) and value > 0


# Leaf-name parts of quantization formats' companion tensors (FP8's weight_scale_inv, GPTQ's
# qweight / qzeros / scales / g_idx, AWQ's, compressed-tensors' weight_packed / zero_point).
QUANT_LEAVES = ("scale", "qweight", "qzeros", "zero_point", "g_idx", "packed", "blocks")


def check_tensors(path: Path, fmt: CheckpointFormat, dtypes: Mapping[str, str]) -> None:
    """Raise ModelSourceError, naming them, for tensors `fmt` does not explain: a leaf other
    than weight / bias / fmt's companions, a companion with no weight, a weight whose dtype
    (safetensors' name: F32, F8_E4M3, I32...) is not float where fmt gives it no scale.
    dtypes: every tensor's safetensors dtype by name."""
    unread: list[str] = []
    for name, dtype in dtypes.items():
        stem, _, leaf = name.rpartition(".")
        if name.endswith(RECOMPUTED) or (leaf == "bias" and dtype in FLOAT_DTYPES):
            continue
        if leaf in fmt.companions:
            ok = f"{stem}.weight" in dtypes
        elif leaf == "weight":
            ok = dtype in FLOAT_DTYPES or _scaled_weight(fmt, stem, dtype, dtypes)
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


def _scaled_weight(fmt: CheckpointFormat, stem: str, dtype: str, dtypes: Mapping[str, str]) -> bool:
    if fmt.method == "fp8-block":
        return dtype == "F8_E4M3" and f"{stem}.weight_scale_inv" in dtypes
    return False


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 w [..., N, K] = q * scale_inv of its (bn, bk) block; scale_inv [..., ceil(N /
    bn), ceil(K / bk)] (the last row and column of blocks may be partial)."""
    n, k = weight.shape[-2:]
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ModelSourceError(
            f"weight_scale_inv has shape {list(scale_inv.shape)} for a weight "
            f"{list(weight.shape)} in blocks of {list(block)}: expected [..., {want[0]}, {want[1]}]"
        )
    scale = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return weight.float() * scale[..., :n, :k]


class CheckpointView(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as the float model's: a quantized `x.weight` comes back
    dequantized to float32 (its companions are hidden); every other tensor as stored. Records
    each name it hands out, companions included, in `read_names`."""

    def __init__(self, weights: Mapping[str, torch.Tensor], fmt: CheckpointFormat):
        self.weights = weights
        self.fmt = fmt
        hidden = {n for n in weights if n.rpartition(".")[2] in fmt.companions}
        self.names = [n for n in weights if n not in hidden]
        self.known = set(self.names)
        self.read_names: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        tensor = self.weights[name]
        self.read_names.add(name)
        stem = name.removesuffix(".weight")
        scale_name = f"{stem}.weight_scale_inv"
        fp8 = self.fmt.method == "fp8-block" and name.endswith(".weight")
        if fp8 and scale_name in self.weights:
            self.read_names.add(scale_name)
            assert self.fmt.block is not None
            tensor = dequantize_fp8_block(tensor, self.weights[scale_name], self.fmt.block)
        return tensor

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
    if fmt.method != "none":
        log.info("checkpoint quantization", model=str(path), quantization=fmt.describe())
    return CheckpointView(weights, fmt)
