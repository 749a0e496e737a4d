"""A `qwen3next` GGUF's tensors as Qwen3-Next's HF names (engine/model/families/qwen3_next.py
reads those), undoing what llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel) did:

    in_proj_qkvz [Hk x (q | k | v | z), H]  was split into  attn_qkv [q all | k all | v all, H]
                                                       and  attn_gate [z all, H]
    A_log   was stored as ssm_a = -exp(A_log)       dt_bias  as ssm_dt.bias
    conv1d  [C, 1, K] was squeezed to [C, K]        every *norm.weight but the DeltaNet's
                                                    gated norm (ssm_norm) as 1 + w

The plain renames (ssm_ba, ssm_out, ...) are common/families/qwen3_next.py's gguf_layer_names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from llmserve.common.gguf_file import GGUFFile
from llmserve.common.model_config import ModelConfig

_QKV = ".linear_attn.in_proj_qkv.weight"
_Z = ".linear_attn.in_proj_z.weight"


def qwen3_next_gguf_tensors(
    inner: Mapping[str, torch.Tensor], file: GGUFFile, config: ModelConfig
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names, read) of the HF checkpoint's tensors out of inner (the GGUF's tensors by the
    family's plain renames) and file (see the module); engine/model/weights.py makes them a
    LazyWeights."""
    extra: dict[str, str] = {}  # HF name -> the GGUF tensor read for it (no `.weight` there)
    for tensor in file.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)", tensor.name)
        if m:
            what = "A_log" if m[2] == "ssm_a" else "dt_bias"
            extra[f"model.layers.{m[1]}.linear_attn.{what}"] = tensor.name
    infos = {t.name: t for t in file.tensors}
    names = [n.replace(_QKV, ".linear_attn.in_proj_qkvz.weight") for n in inner if _Z not in n]

    def read(name: str) -> torch.Tensor:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            stem = name.removesuffix(".linear_attn.in_proj_qkvz.weight")
            return _join_qkvz(inner[stem + _QKV], inner[stem + _Z], config)
        if name in extra:
            data = torch.from_numpy(file.tensor_array(infos[extra[name]]).copy())
            return (-data).log() if name.endswith("A_log") else data
        data = inner[name]
        if name.endswith(".linear_attn.conv1d.weight"):
            return data.unsqueeze(1)
        if name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
            return data - 1.0
        return data

    return [*names, *extra], read


def _join_qkvz(qkv: torch.Tensor, z: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF's per-key-head groups [q (dk), k (dk), v (g dv), z (g dv)] out of the converter's
    [q all heads | k | v] and [z]."""
    d = config.gated_delta_net
    assert d is not None
    hk, hidden = d.num_k_heads, qkv.shape[-1]
    q, k, v = qkv.split([d.key_dim, d.key_dim, d.value_dim])
    parts = [x.reshape(hk, -1, hidden) for x in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)
