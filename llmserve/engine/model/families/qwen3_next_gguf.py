"""A `qwen3next`, `qwen35` or `qwen35moe` GGUF's tensors as Qwen3-Next's / Qwen3.5's HF names
(engine/model/families/qwen3_next.py reads those), undoing what llama.cpp's converter
(convert_hf_to_gguf.py: Qwen3NextModel, and for Qwen3.5 _LinearAttentionVReorderBase on top of
it) did:

    in_proj_qkvz [Hk x (q | k | v | z), H]  was split into  attn_qkv [q all | k all | v all, H]
    (Qwen3-Next)                                       and  attn_gate [z all, H]
    A_log   was stored as ssm_a = -exp(A_log)       dt_bias  as ssm_dt.bias
    conv1d  [C, 1, K] was squeezed to [C, K]        every *norm.weight but the DeltaNet's
                                                    gated norm (ssm_norm) as 1 + w
    Qwen3.5, value heads (Hv = r Hk): from HF's grouped order (key head 0's r value heads, key
    head 1's, ...) to tiled (value head 0 of every key head, then 1, ...) in every tensor
    indexed by them: in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a, A_log, dt_bias,
    the conv's v channels and out_proj's columns.

The plain renames (ssm_ba, ssm_out, ...) are common/families/qwen3_next.py's gguf_layer_names
(qwen3_5.py's for Qwen3.5).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from llmserve.common.gguf_file import GGUFFile
from llmserve.common.model_config import ModelConfig
from llmserve.common.state_layout import GatedDeltaNetConfig

_QKV = ".linear_attn.in_proj_qkv.weight"
_Z = ".linear_attn.in_proj_z.weight"
Tensors = tuple[list[str], Callable[[str], torch.Tensor]]


def qwen3_next_gguf_tensors(
    inner: Mapping[str, torch.Tensor], file: GGUFFile, config: ModelConfig
) -> Tensors:
    """(names, read) of the HF checkpoint's tensors out of inner (the GGUF's tensors by the
    family's plain renames) and file (see the module); engine/model/weights.py makes them a
    LazyWeights."""
    extra = _state_parameters(file)
    names = [n.replace(_QKV, ".linear_attn.in_proj_qkvz.weight") for n in inner if _Z not in n]

    def read(name: str) -> torch.Tensor:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            stem = name.removesuffix(".linear_attn.in_proj_qkvz.weight")
            return _join_qkvz(inner[stem + _QKV], inner[stem + _Z], config)
        if name in extra:
            return _read_state_parameter(file, name, extra[name])
        return _as_hf(name, inner[name])

    return [*names, *extra], read


def qwen3_5_gguf_tensors(
    inner: Mapping[str, torch.Tensor], file: GGUFFile, config: ModelConfig
) -> Tensors:
    """qwen3_next_gguf_tensors for Qwen3.5: its projections stay flat (in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a, as HF stores them), the value heads put back in HF's order."""
    d = config.gated_delta_net
    assert d is not None
    extra = _state_parameters(file)

    def read(name: str) -> torch.Tensor:
        if name in extra:
            return _untile(_read_state_parameter(file, name, extra[name]), 0, d, 1)
        data = inner[name]
        part = name.partition(".linear_attn.")[2]
        if part in ("in_proj_qkv.weight", "conv1d.weight"):  # rows / channels [q | k | v]
            qk, v = data.split([2 * d.key_dim, d.value_dim])
            data = torch.cat((qk, _untile(v, 0, d, d.head_v_dim)))
        elif part == "in_proj_z.weight":
            data = _untile(data, 0, d, d.head_v_dim)
        elif part in ("in_proj_b.weight", "in_proj_a.weight"):
            data = _untile(data, 0, d, 1)
        elif part == "out_proj.weight":
            data = _untile(data, 1, d, d.head_v_dim)
        return _as_hf(name, data)

    return [*inner, *extra], read


def _state_parameters(file: GGUFFile) -> dict[str, str]:
    """HF name -> the GGUF tensor read for it, of the DeltaNet's A_log and dt_bias (stored as
    ssm_a and ssm_dt.bias: no `.weight`, so the plain renames leave them out)."""
    extra: dict[str, str] = {}
    for tensor in file.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)", tensor.name)
        if m:
            what = "A_log" if m[2] == "ssm_a" else "dt_bias"
            extra[f"model.layers.{m[1]}.linear_attn.{what}"] = tensor.name
    return extra


def _read_state_parameter(file: GGUFFile, name: str, tensor: str) -> torch.Tensor:
    info = next(t for t in file.tensors if t.name == tensor)
    data = torch.from_numpy(file.tensor_array(info).copy())
    return (-data).log() if name.endswith("A_log") else data


def _as_hf(name: str, data: torch.Tensor) -> torch.Tensor:
    """The conv's taps back to [C, 1, K]; a zero-centred norm's weight back to w."""
    if name.endswith(".linear_attn.conv1d.weight"):
        return data.unsqueeze(1)
    if name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
        return data - 1.0
    return data


def _untile(x: torch.Tensor, dim: int, d: GatedDeltaNetConfig, size: int) -> torch.Tensor:
    """x's value heads (each `size` wide along dim) from the converter's tiled order back to
    HF's grouped one: index (j, k) of [r, Hk] -> (k, j) of [Hk, r]."""
    hk = d.num_k_heads
    shape = x.shape
    parts = (*shape[:dim], d.num_v_heads // hk, hk, size, *shape[dim + 1 :])
    return x.reshape(parts).transpose(dim, dim + 1).reshape(shape)


def _join_qkvz(qkv: torch.Tensor, z: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF's per-key-head groups [q (dk), k (dk), v (g dv), z (g dv)] out of the converter's
    [q all heads | k | v] and [z]."""
    d = config.gated_delta_net
    assert d is not None
    hk, hidden = d.num_k_heads, qkv.shape[-1]
    q, k, v = qkv.split([d.key_dim, d.key_dim, d.value_dim])
    parts = [x.reshape(hk, -1, hidden) for x in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)
