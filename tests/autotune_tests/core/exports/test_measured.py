"""LoRA "all-linear" is exported as measured on any model: the engine leaves out the output head
of presets and factories too, which peft does by itself only on transformers models (llama-tiny:
the export once trained 215,552 parameters where 147,968 were measured)."""

from __future__ import annotations

import pytest
import torch

from autotune.core.exports.measured import lora_config
from autotune.core.presets import PRESETS
from autotune.core.schemas import LoraSpec, TrainingSpec
from autotune.engine.training.adapters import apply_lora, trainable_parameter_count
from autotune.engine.training.zoo import build_model


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_all_linear_adapters_on_a_preset_are_the_measured_ones(preset: str) -> None:
    peft = pytest.importorskip("peft")
    training = TrainingSpec(lora=LoraSpec(r=8))
    torch.manual_seed(0)
    measured = trainable_parameter_count(apply_lora(build_model(PRESETS[preset]), training.lora))
    config = lora_config(training)
    assert config is not None
    exported = peft.get_peft_model(build_model(PRESETS[preset]), peft.LoraConfig(**config))
    assert trainable_parameter_count(exported) == measured
    # Without the exclusion peft adapts the head as well: the defect this guards.
    del config["exclude_modules"]
    more = peft.get_peft_model(build_model(PRESETS[preset]), peft.LoraConfig(**config))
    assert trainable_parameter_count(more) > measured
