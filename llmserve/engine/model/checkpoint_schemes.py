"""The quantized checkpoint formats the loader reads, one class each, made from config.json's
`quantization_config` (`read_scheme`): which tensors hold a quantized weight (`primaries`: name
suffix -> safetensors dtypes), which travel with it (`companions`, of which `required` must be
there), the float name the model asks for (`presented`), and how the weight comes back as float32
(`dequantize`, through engine/model/checkpoint_dequant.py), or kept as stored for the CPU
kernels (`kept`: engine/model/kept_weights.py; None where a weight does not fit). A method,
option or value a class does not read raises ModelSourceError naming it.
engine/model/checkpoint_formats.py applies the rule that no tensor goes unread;
docs/quantization.md has the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.common.model_config import ModelSourceError
from llmserve.engine.model.checkpoint_dequant import (
    awq_columns,
    dequantize_awq,
    dequantize_ct,
    dequantize_fp8_block,
    dequantize_gptq,
    dequantize_mxfp4,
    expand_groups,
    unpack_int32,
)
from llmserve.engine.model.kept_weights import KeptWeight, fp8_weight, int_weight, mxfp4_weights

SUPPORTED = (
    "fp8 (weight_block_size), compressed-tensors (pack-quantized, int-quantized, "
    "float-quantized), gptq (2, 4, 8 bits), awq (gemm, 4 bits), mxfp4"
)
# A module's stored tensor by name suffix (".weight_scale"), or None where it has none; each
# tensor handed out is recorded as read.
Getter = Callable[[str], "torch.Tensor | None"]
# compressed-tensors' stored (q, scale, zero_point, g_idx) of one module
CtTensors = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def _need(get: Getter, stem: str, suffix: str) -> torch.Tensor:
    tensor = get(suffix)
    if tensor is None:
        raise ModelSourceError(f"{stem}{suffix} is missing beside {stem}'s quantized weight")
    return tensor


@dataclass(frozen=True)
class WeightScheme:
    """The scheme of a checkpoint with no quantization_config (float tensors only), and the
    base each format's scheme below fills in."""

    primaries: dict[str, tuple[str, ...]] = field(default_factory=dict)
    companions: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    def presented(self, stem: str) -> str:
        return f"{stem}.weight"

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        raise AssertionError("an unquantized checkpoint has no quantized weight")

    def kept(self, stem: str, get: Getter) -> KeptWeight | None:
        """The weight as stored, for the CPU kernels; None: dequantize it instead."""
        return None

    def kept_stack(self, stem: str, get: Getter) -> list[KeptWeight] | None:
        """A stacked [E, N, K] weight (fused experts) as stored, one KeptWeight per row of
        the first dimension; None: dequantize it instead."""
        return None

    def scale_form(self, stem: str, get: Getter) -> tuple[torch.Tensor, int] | None:
        """(each weight's scale float32 [N, K], bits) of an integer weight w = s * (q - z), for
        engine/model/checkpoint_blocks.py to hold it in the CPU kernel's blocks; None where the
        scheme is not integer weights (fp8, mxfp4) or is per tensor."""
        return None

    def describe(self) -> str:
        return "none"


@dataclass(frozen=True)
class Fp8Block(WeightScheme):
    """`quant_method: fp8` with `weight_block_size` (DeepSeek-V3, Qwen3 FP8): float8_e4m3fn
    `weight` with float32 `weight_scale_inv` per block."""

    block: tuple[int, int] = (128, 128)
    primaries: dict[str, tuple[str, ...]] = field(default_factory=lambda: {".weight": ("F8_E4M3",)})
    companions: tuple[str, ...] = (".weight_scale_inv",)
    required: tuple[str, ...] = (".weight_scale_inv",)

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        weight = _need(get, stem, ".weight")
        return dequantize_fp8_block(weight, _need(get, stem, ".weight_scale_inv"), self.block)

    def kept(self, stem: str, get: Getter) -> KeptWeight | None:
        return fp8_weight(_need(get, stem, ".weight"), _need(get, stem, ".weight_scale_inv"),
                          self.block)  # fmt: skip

    def describe(self) -> str:
        return f"fp8-block {list(self.block)}"


@dataclass(frozen=True)
class Gptq(WeightScheme):
    """`quant_method: gptq` (AutoGPTQ, GPTQModel): `qweight`, `qzeros`, `scales`, `g_idx`."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    zero_offset: int = 1
    primaries: dict[str, tuple[str, ...]] = field(default_factory=lambda: {".qweight": ("I32",)})
    companions: tuple[str, ...] = (".qzeros", ".scales", ".g_idx")
    required: tuple[str, ...] = (".qzeros", ".scales")

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        qweight = _need(get, stem, ".qweight")
        k = qweight.shape[0] * (32 // self.bits)
        group = self.group_size if self.group_size > 0 else k
        g_idx = get(".g_idx")
        if self.desc_act and g_idx is None:
            raise ModelSourceError(f"{stem}.g_idx is missing: desc_act (act-order) needs it")
        return dequantize_gptq(
            qweight, _need(get, stem, ".qzeros"), _need(get, stem, ".scales"), g_idx,
            self.bits, group, self.zero_offset,
        )  # fmt: skip

    def kept(self, stem: str, get: Getter) -> KeptWeight | None:
        qweight, scales = _need(get, stem, ".qweight"), _need(get, stem, ".scales")
        k, n = qweight.shape[0] * (32 // self.bits), scales.shape[1]
        qzeros = _need(get, stem, ".qzeros")
        if self.bits not in (4, 8) or qzeros.shape != (scales.shape[0], n * self.bits // 32):
            return None
        zeros = unpack_int32(qzeros, self.bits, n) + self.zero_offset  # [G, N]
        q = unpack_int32(qweight.t(), self.bits, k)
        group = self.group_size if self.group_size > 0 else k
        return int_weight(self.bits, q, scales.t(), zeros.t(), group, get(".g_idx"))

    def scale_form(self, stem: str, get: Getter) -> tuple[torch.Tensor, int] | None:
        scales = _need(get, stem, ".scales")
        k = _need(get, stem, ".qweight").shape[0] * (32 // self.bits)
        group = self.group_size if self.group_size > 0 else k
        return expand_groups(scales.t().float(), k, group, get(".g_idx")), self.bits

    def describe(self) -> str:
        order = ", act-order" if self.desc_act else ""
        version = "gptq" if self.zero_offset else "gptq_v2"
        return f"{version} {self.bits}-bit group {self.group_size}{order}"


@dataclass(frozen=True)
class Awq(WeightScheme):
    """`quant_method: awq`, `version: gemm` (AutoAWQ): `qweight`, `qzeros`, `scales`."""

    group_size: int = 128
    primaries: dict[str, tuple[str, ...]] = field(default_factory=lambda: {".qweight": ("I32",)})
    companions: tuple[str, ...] = (".qzeros", ".scales")
    required: tuple[str, ...] = (".qzeros", ".scales")

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        return dequantize_awq(
            _need(get, stem, ".qweight"), _need(get, stem, ".qzeros"),
            _need(get, stem, ".scales"), self.group_size,
        )  # fmt: skip

    def kept(self, stem: str, get: Getter) -> KeptWeight | None:
        qweight, scales = _need(get, stem, ".qweight"), _need(get, stem, ".scales")
        n = scales.shape[1]
        q, zeros = (awq_columns(t, n).t() for t in (qweight, _need(get, stem, ".qzeros")))
        return int_weight(4, q, scales.t(), zeros, self.group_size)

    def scale_form(self, stem: str, get: Getter) -> tuple[torch.Tensor, int] | None:
        k = _need(get, stem, ".qweight").shape[0]
        scales = _need(get, stem, ".scales").t().float()
        return expand_groups(scales, k, self.group_size), 4

    def describe(self) -> str:
        return f"awq gemm int4 group {self.group_size}"


@dataclass(frozen=True)
class Mxfp4(WeightScheme):
    """`quant_method: mxfp4` (gpt-oss): `X_blocks` (e2m1 pairs) and `X_scales` (e8m0) are the
    float tensor `X` [..., rows, G * 32], in the stored orientation."""

    primaries: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"_blocks": ("U8",)})
    companions: tuple[str, ...] = ("_scales",)
    required: tuple[str, ...] = ("_scales",)

    def presented(self, stem: str) -> str:
        return stem

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        return dequantize_mxfp4(_need(get, stem, "_blocks"), _need(get, stem, "_scales"))

    def kept_stack(self, stem: str, get: Getter) -> list[KeptWeight] | None:
        blocks, scales = _need(get, stem, "_blocks"), _need(get, stem, "_scales")
        if blocks.dim() != 4 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            return None
        return mxfp4_weights(blocks, scales)

    def describe(self) -> str:
        return "mxfp4"


@dataclass(frozen=True)
class CtGroup:
    """One of compressed-tensors' config_groups: the modules it targets and their weights."""

    targets: tuple[str, ...]
    format: str
    type: str
    bits: int
    strategy: str
    size: tuple[int, int]  # group: (1, group_size); block: block_structure
    symmetric: bool
    activations: str

    def matches(self, stem: str) -> bool:
        return any(_ct_match(t, stem) for t in self.targets)

    def describe(self) -> str:
        kind = f"{self.type}{self.bits}"
        extent = {"group": f" {self.size[1]}", "block": f" {list(self.size)}"}.get(self.strategy)
        sym = "" if self.symmetric else " asymmetric"
        return f"{self.format} {kind} {self.strategy}{extent or ''}{sym}{self.activations}"


Unquantized = WeightScheme


def _ct_match(target: str, stem: str) -> bool:
    """compressed-tensors' target rule: `re:` a regular expression matched at the start of the
    module's name, else the module's name or its class (every quantized module here is a
    Linear)."""
    if target.startswith("re:"):
        return re.match(target[3:], stem) is not None
    return target in (stem, "Linear")


@dataclass(frozen=True)
class CompressedTensors(WeightScheme):
    """`quant_method: compressed-tensors` (llm-compressor; vLLM's quantized zoo): each module's
    scheme is the first config group whose targets match it."""

    groups: tuple[CtGroup, ...] = ()
    primaries: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {".weight_packed": ("I32",), ".weight": ("I8", "F8_E4M3")}
    )
    companions: tuple[str, ...] = (
        ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
        ".input_scale", ".input_zero_point",
    )  # fmt: skip
    required: tuple[str, ...] = (".weight_scale",)

    def group_for(self, stem: str) -> CtGroup:
        for group in self.groups:
            if group.matches(stem):
                return group
        targets = [t for g in self.groups for t in g.targets]
        raise ModelSourceError(
            f"{stem} holds quantized tensors but no compressed-tensors config group targets it "
            f"(targets: {targets})"
        )

    def stored(self, stem: str, get: Getter) -> tuple[CtGroup, CtTensors]:
        """The module's group and (q, scale, zero_point, g_idx) as stored, q unpacked."""
        group = self.group_for(stem)
        packed = get(".weight_packed")
        if (packed is not None) != (group.format == "pack-quantized"):
            raise ModelSourceError(f"{stem}: its tensors are not in its group's {group.format}")
        zero_point = get(".weight_zero_point")
        if packed is not None:
            shape = [int(s) for s in _need(get, stem, ".weight_shape")]
            offset = 1 << (group.bits - 1)  # values stored as unsigned: q + 2^(bits - 1)
            q = unpack_int32(packed, group.bits, shape[-1]) - offset
            # packed along the rows since compressed-tensors 0.9; earlier files hold them as int8
            packed_zero = zero_point is not None and zero_point.shape[-2] != shape[-2]
            if packed_zero and group.strategy in ("group", "channel"):
                assert zero_point is not None
                rows = unpack_int32(zero_point.transpose(-1, -2), group.bits, shape[-2])
                zero_point = (rows - offset).transpose(-1, -2)
        else:
            q = _need(get, stem, ".weight")
        if not group.symmetric and zero_point is None:
            raise ModelSourceError(f"{stem}.weight_zero_point is missing (asymmetric scheme)")
        for activation in (".input_scale", ".input_zero_point"):
            get(activation)  # static activation parameters: read, recorded, not emulated
        scale = _need(get, stem, ".weight_scale")
        return group, (q, scale, zero_point, get(".weight_g_idx"))

    def dequantize(self, stem: str, get: Getter) -> torch.Tensor:
        group, (q, scale, zero_point, g_idx) = self.stored(stem, get)
        return dequantize_ct(q, scale, zero_point, group.strategy, group.size, g_idx)

    def kept(self, stem: str, get: Getter) -> KeptWeight | None:
        group, (q, scale, zero_point, g_idx) = self.stored(stem, get)
        n, k = q.shape[-2:]
        size = {"tensor": (n, k), "channel": (1, k)}.get(group.strategy, group.size)
        if q.dim() != 2:  # experts: dequantized
            return None
        if group.type == "float":
            return None if zero_point is not None else fp8_weight(q, scale, size)
        scale = _per_row(scale, n, size[0])
        zero_point = None if zero_point is None else _per_row(zero_point, n, size[0])
        return int_weight(group.bits, q, scale, zero_point, size[1], g_idx)

    def scale_form(self, stem: str, get: Getter) -> tuple[torch.Tensor, int] | None:
        group = self.group_for(stem)
        if group.type != "int" or group.strategy not in ("group", "channel"):
            return None
        packed = get(".weight_packed")
        k = int(_need(get, stem, ".weight_shape")[-1]) if packed is not None else None
        k = k if k is not None else _need(get, stem, ".weight").shape[-1]
        scale = _need(get, stem, ".weight_scale").float()
        size = group.size[1] if group.strategy == "group" else k
        return expand_groups(scale, k, size, get(".weight_g_idx")), group.bits

    def describe(self) -> str:
        return "compressed-tensors " + "; ".join(dict.fromkeys(g.describe() for g in self.groups))


def _per_row(table: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """A scale or zero-point table [N or ceil(N / rows) or 1, G] as one row per output channel."""
    table = table.reshape(-1, table.shape[-1]) if table.dim() else table.reshape(1, 1)
    return table if table.shape[0] == n else table.repeat_interleave(rows, dim=0)[:n]


def read_scheme(path: Path, qc: Any) -> WeightScheme:
    """The scheme a `quantization_config` declares; ModelSourceError naming what is not read."""
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    where = f"{path}: config.json quantization_config"
    readers: dict[str, Callable[[str, dict[str, Any]], WeightScheme]] = {
        "fp8": _fp8, "compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq,
        "mxfp4": lambda where, qc: Mxfp4(),
    }  # fmt: skip
    if method not in readers:
        raise ModelSourceError(
            f"{where}.quant_method={method!r} is not supported (supported: {SUPPORTED}); "
            "refusing to serve it rather than ignore its tensors"
        )
    return readers[method](where, qc)


def _refuse(where: str, key: str, value: object, supported: str) -> ModelSourceError:
    return ModelSourceError(f"{where}.{key}={value!r} is not supported (supported: {supported})")


def _positive(value: object) -> bool:
    return isinstance(value, int) and value > 0


def _fp8(where: str, qc: dict[str, Any]) -> WeightScheme:
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
        raise ModelSourceError(
            f"{where}.weight_block_size={block!r}: fp8 is read block-scaled only, with two "
            f"positive block sizes (per-tensor fp8: the compressed-tensors format)"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(where, "activation_scheme", qc.get("activation_scheme"), "'dynamic'")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(where, "fmt", qc.get("fmt"), "'e4m3'")
    return Fp8Block(block=(int(block[0]), int(block[1])))


def _gptq(where: str, qc: dict[str, Any]) -> WeightScheme:
    bits, group_size = qc.get("bits"), qc.get("group_size", 128)
    if bits not in (2, 4, 8):
        raise _refuse(where, "bits", bits, "2, 4, 8")
    if not (group_size == -1 or _positive(group_size)):
        raise _refuse(where, "group_size", group_size, "-1 or a positive size")
    version = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if version not in ("gptq", "gptq_v2"):
        raise _refuse(where, "checkpoint_format", version, "'gptq', 'gptq_v2'")
    return Gptq(
        bits=bits, group_size=group_size, desc_act=bool(qc.get("desc_act", False)),
        zero_offset=1 if version == "gptq" else 0,
    )  # fmt: skip


def _awq(where: str, qc: dict[str, Any]) -> WeightScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(where, "version", qc.get("version"), "'gemm'")
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise _refuse(where, "bits", qc.get("bits", qc.get("w_bit")), "4")
    if not qc.get("zero_point", True):
        raise _refuse(where, "zero_point", False, "true")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not _positive(group_size):
        raise _refuse(where, "group_size", group_size, "a positive size")
    return Awq(group_size=group_size)


CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


def _compressed_tensors(where: str, qc: dict[str, Any]) -> WeightScheme:
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if qc.get(key):
            raise _refuse(where, key, qc[key], "none")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(where, "quantization_status", qc.get("quantization_status"), "compressed")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(where, "config_groups", groups, "at least one group")
    return CompressedTensors(
        groups=tuple(_ct_group(f"{where}.config_groups.{n}", g, qc) for n, g in groups.items())
    )


def _ct_group(where: str, group: dict[str, Any], qc: dict[str, Any]) -> CtGroup:
    fmt = group.get("format") or qc.get("format")
    if fmt not in CT_FORMATS:
        raise _refuse(where, "format", fmt, ", ".join(CT_FORMATS))
    if group.get("output_activations"):
        raise _refuse(where, "output_activations", group["output_activations"], "none")
    w = group.get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if kind == "float" and (bits != 8 or fmt == "pack-quantized"):
        raise _refuse(where, "weights.num_bits", bits, "8 (float8 e4m3), not packed")
    if kind == "int" and bits not in ((2, 4, 8) if fmt == "pack-quantized" else range(2, 9)):
        raise _refuse(where, "weights.num_bits", bits, "2, 4, 8 packed; 2..8 as int8")
    if kind not in ("int", "float"):
        raise _refuse(where, "weights.type", kind, "'int', 'float'")
    if w.get("dynamic"):
        raise _refuse(where, "weights.dynamic", w["dynamic"], "false")
    size = _ct_size(where, strategy, w)
    activations = group.get("input_activations")
    if activations and activations.get("num_bits") != 8:
        raise _refuse(where, "input_activations.num_bits", activations.get("num_bits"), "8")
    act = f" a{activations['type']}8 (not emulated)" if activations else ""
    targets = tuple(group.get("targets") or ())
    symmetric = bool(w.get("symmetric", True))
    return CtGroup(targets, fmt, kind, int(bits or 0), str(strategy), size, symmetric, act)


def _ct_size(where: str, strategy: object, w: dict[str, Any]) -> tuple[int, int]:
    if strategy in ("tensor", "channel"):
        return (1, 1)
    if strategy == "group" and _positive(w.get("group_size")):
        return (1, w["group_size"])
    block = w.get("block_structure")
    if strategy == "block" and isinstance(block, list) and all(_positive(b) for b in block):
        return (block[0], block[1])
    raise _refuse(
        where, "weights.strategy", strategy,
        "tensor, channel, group with group_size, block with block_structure",
    )  # fmt: skip
