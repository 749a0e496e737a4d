"""Dummy weights (`--load-format dummy`): seeded random values for any HF Llama config.json, made
directly on the target device in the target dtype, so real model shapes run without a download
and an 8B model in bf16 is never materialized in float32 on the CPU.

Element i of HF tensor `name` is a function of (seed, name, i) only (`standard_values`), so the
same seed gives bit-identical weights on the CPU and a GPU. Linear and embedding weights and
biases: mean 0, std 0.02 (HF's initializer_range); RMSNorm weights: mean 1, std 0.02. Fused
parameters are filled slice by slice under their HF names, so `dummy_state_dict` loads into
HF's LlamaForCausalLM as exactly the model the engine runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.families import model_class
from llmserve.engine.model.layers import Linear
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import Experts

WEIGHT_STD = 0.02
NORM_STD = 0.02
# Elements generated at a time: on a CPU, int64 temporaries that stay in cache (larger chunks run
# 10x slower); on a GPU, large enough that kernel launches do not dominate.
CHUNK = {"cpu": 1 << 15, "cuda": 1 << 24}

_MASK16 = 0xFFFF
_MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers; the second, 0x846CA68B, as -(2^32 - it), so that
_C2_NEG = (1 << 32) - 0x846CA68B  # every product of a 32-bit value stays below 2^63
# Sum of four uniforms on [0, 65535]: mean 2 * 65535, std sqrt(4 * (65536^2 - 1) / 12).
_IRWIN_HALL_MEAN = 2 * 65535
_IRWIN_HALL_STD = (4 * (65536**2 - 1) / 12) ** 0.5


def tensor_keys(seed: int, name: str) -> tuple[int, int]:
    """Two 31-bit keys for one (seed, HF tensor name), stable across processes and machines."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value & 0x7FFFFFFF, (value >> 32) & 0x7FFFFFFF


def _hash32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in [0, 2^32), in place (scratch: a tensor like x)."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))
    x.mul_(_C1).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=scratch))
    x.mul_(_C2_NEG).neg_().bitwise_and_(_MASK32)  # x * 0x846CA68B mod 2^32
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


def standard_values(
    keys: tuple[int, int], start: int, count: int, device: torch.device
) -> torch.Tensor:
    """float32 values of mean 0 and std 1 for elements [start, start + count) of one tensor.

    Each value is the sum of four 16-bit uniforms taken from two 32-bit hashes of the element's
    index (Irwin-Hall, n = 4: near-normal, bounded at +-3.46 sigma), centred and scaled in
    float32, so it depends on (keys, index) only: the same on any device, in any chunking."""
    h1 = torch.arange(start, start + count, dtype=torch.int64, device=device)
    h2 = torch.bitwise_xor(h1, keys[1])
    h1.bitwise_xor_(keys[0])
    scratch = torch.empty_like(h1)
    _hash32_(h1, scratch)
    _hash32_(h2, scratch)
    total = torch.bitwise_and(h1, _MASK16, out=scratch).add_(h1.bitwise_right_shift_(16))
    total.add_(h2.bitwise_and(_MASK16)).add_(h2.bitwise_right_shift_(16))
    return total.sub_(_IRWIN_HALL_MEAN).to(torch.float32).mul_(1.0 / _IRWIN_HALL_STD)


@torch.no_grad()
def fill_dummy_(out: torch.Tensor, seed: int, name: str, std: float, mean: float = 0.0) -> None:
    """Overwrite `out` (contiguous, any dtype and device) with the values of HF tensor `name`."""
    if not out.is_contiguous():
        raise ValueError(f"{name}: dummy weights need a contiguous tensor")
    numel = out.numel()
    if numel >= 1 << 32:
        raise ValueError(f"{name}: {numel} elements; the generator indexes at most 2^32")
    keys = tensor_keys(seed, name)
    flat = out.view(-1)
    chunk = CHUNK.get(out.device.type, 1 << 24)
    for start in range(0, numel, chunk):
        count = min(chunk, numel - start)
        values = standard_values(keys, start, count, out.device).mul_(std).add_(mean)
        flat[start : start + count].copy_(values)


def fill_hf_tensor_(out: torch.Tensor, seed: int, name: str) -> None:
    """The dummy values of HF tensor `name`: norms around 1, everything else around 0."""
    if name.endswith("norm.weight"):
        fill_dummy_(out, seed, name, NORM_STD, mean=1.0)
    else:
        fill_dummy_(out, seed, name, WEIGHT_STD)


def hf_parameter_slices(model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """(HF name, the view of our parameter holding it) for every tensor HF's LlamaForCausalLM
    has; fused q/k/v and gate/up are split into their HF rows. Tied embeddings appear once."""
    return [
        (name, module.shard(param, shard) if isinstance(module, Linear | Experts) else param)
        for name, module, param, shard in model.hf_tensors()
    ]


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Fill every parameter of `model` in place (on its device, in its dtype) with the dummy
    values of its HF tensors. Must run before `replace_linears` (packing or quantizing copies
    the weights). A parameter stored in another layout than HF's (a module with `hf_shape`:
    gpt-oss's experts) is filled as the HF tensor, then loaded through its weight_loader."""
    for name, tensor in hf_parameter_slices(model):
        fill_hf_tensor_(tensor, seed, name)
    for name, module, param, shard in model.hf_tensors():
        hf_shape = getattr(module, "hf_shape", None)
        if hf_shape is not None:
            whole = torch.empty(hf_shape(param), dtype=param.dtype, device=param.device)
            fill_hf_tensor_(whole, seed, name)
            module.weight_loader(param, whole, shard)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of HF's LlamaForCausalLM for `config` (tied embeddings:
    no lm_head.weight), read off our model on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = model_class(config)(config, 1)
    shapes = {name: tuple(tensor.shape) for name, tensor in hf_parameter_slices(model)}
    for name, module, param, _ in model.hf_tensors():
        if hasattr(module, "hf_shape"):
            shapes[name] = tuple(module.hf_shape(param))
    return shapes


class DummyWeights(Mapping[str, torch.Tensor]):
    """The dummy values as HF tensors, each made whole (on `device`, in `dtype`) when looked up:
    for a sharded model, which takes its slice of each (engine/weights.build_model)."""

    def __init__(self, config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device):
        self.shapes = hf_tensor_shapes(config)
        self.seed, self.dtype, self.device = seed, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
        fill_hf_tensor_(out, self.seed, name)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
