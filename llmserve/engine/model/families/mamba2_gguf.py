"""A Mamba-2 hybrid GGUF's tensors (`granitehybrid`, `nemotron_h` / `nemotron_h_moe`,
`falcon-h1`) as the HF names Granite 4.0-H's, Nemotron-H's and Falcon-H1's models read,
undoing what llama.cpp's converter (convert_hf_to_gguf.py, Mamba2Model and its subclasses) did:

    A_log   was stored as ssm_a = -exp(A_log), [H, 1]     D        as ssm_d, [H, 1]
    dt_bias as ssm_dt.bias                                conv1d   [C, 1, K] squeezed to [C, K]
    the mixer's norm [I] reshaped to [groups, I / groups]
    Granite: input_linear [.., 2 I, H] split into gate and up (ffn_*_exps, ffn_*_shexp or,
             without experts, ffn_gate / ffn_up): joined back here
    Nemotron-H: names under `backbone.`, the experts stacked [E, ..] (read per expert here)

The plain renames are each family's gguf_layer_names (common/families); Granite's and
Nemotron-H's q / k rows are unpermuted as Llama's (engine/model/weights.py). Falcon-H1's
multipliers, which the converter multiplied into the weights, stay there (its GGUF config
reads them as 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from llmserve.common.gguf_file import GGUFFile
from llmserve.common.model_config import ModelConfig

# the Mamba mixer's module in each family's HF names
_MIXER = {"granite_hybrid": "mamba", "nemotron_h": "mixer", "falcon_h1": "mamba"}
_EXTRA = {"ssm_a": "A_log", "ssm_d": "D", "ssm_dt.bias": "dt_bias"}
_HALVES = (".gate_half.weight", ".up_half.weight")


def mamba2_gguf_tensors(
    inner: Mapping[str, torch.Tensor], file: GGUFFile, config: ModelConfig
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names, read) of the HF checkpoint's tensors out of inner (the GGUF's tensors by the
    family's plain renames) and file (see the module); engine/model/weights.py makes them a
    LazyWeights."""
    mixer = _MIXER[config.family]
    extra: dict[str, str] = {}  # HF name -> the GGUF tensor read for it (no `.weight` there)
    for tensor in file.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_d|ssm_dt\.bias)", tensor.name)
        if m:
            extra[f"model.layers.{m[1]}.{mixer}.{_EXTRA[m[2]]}"] = tensor.name
    infos = {t.name: t for t in file.tensors}
    source: dict[str, tuple[str, int | None]] = {}  # HF name -> (inner's name, expert)
    for name in [*inner, *extra]:
        for ours, expert in _hf_names(name, config):
            source[ours] = (name, expert)

    def read(name: str) -> torch.Tensor:
        stem, expert = source[name]
        if stem in extra:
            data = torch.from_numpy(file.tensor_array(infos[extra[stem]]).copy()).reshape(-1)
            return (-data).log() if stem.endswith(".A_log") else data
        if stem.endswith(_HALVES[0]):  # Granite's input_linear: [gate | up] rows
            up = inner[stem.removesuffix(_HALVES[0]) + _HALVES[1]]
            return torch.cat((inner[stem], up), dim=-2)
        data = inner[stem]
        if expert is not None:
            return data[expert]
        if stem.endswith(f".{mixer}.conv1d.weight"):
            return data.unsqueeze(1)
        if stem.endswith(f".{mixer}.norm.weight"):
            return data.reshape(-1)
        return data

    return list(source), read


def _hf_names(name: str, config: ModelConfig) -> list[tuple[str, int | None]]:
    """The HF names (with the expert read, for stacked experts) a renamed GGUF tensor fills."""
    if name.endswith(_HALVES[1]):
        return []  # read with its gate half
    if name.endswith(_HALVES[0]):
        return [(name.removesuffix(_HALVES[0]) + ".weight", None)]
    if config.family == "falcon_h1":
        return [(re.sub(r"^model\.norm\.", "model.final_layernorm.", name), None)]
    if config.family != "nemotron_h":
        return [(name, None)]
    ours = re.sub(r"^model\.embed_tokens\.", "backbone.embeddings.", name)
    ours = re.sub(r"^model\.norm\.", "backbone.norm_f.", ours)
    ours = re.sub(r"^model\.", "backbone.", ours)
    ours = ours.replace(".e_score_correction.bias", ".e_score_correction_bias")
    m = re.fullmatch(r"(.*\.mixer\.experts)\.(up_proj|down_proj)\.weight", ours)
    if m is None:
        return [(ours, None)]
    assert config.moe is not None, "nemotron_h: stacked experts without the expert keys"
    return [(f"{m[1]}.{e}.{m[2]}.weight", e) for e in range(config.moe.num_experts)]
