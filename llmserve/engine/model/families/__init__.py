"""The engine's half of the family registry (common/families/ holds the other): the model class
each family's record names, imported when a model of that family is built."""

from __future__ import annotations

import importlib

from llmserve.common.families import FAMILIES
from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.model import LlamaForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model definition of config's family ("module:Class" in its record)."""
    module, _, name = FAMILIES[config.family].model.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, LlamaForCausalLM), f"{config.family}: {cls} is not a model class"
    return cls
