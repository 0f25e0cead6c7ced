"""Axolotl example configs of a current release (tests/data/axolotl/SOURCE.md), read as specs:
what maps, what is named as not mapped, and the quantized bases refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.configs import ConfigFormat, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, WeightsDtype
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES, tiny_llama_directory


def test_the_llama_lora_example() -> None:
    converted = load_training_file(AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml")
    assert converted.format is ConfigFormat.AXOLOTL
    spec = converted.spec
    assert spec.model.hf_id == "NousResearch/Llama-3.2-1B"
    training = spec.training
    assert (training.seq_len, training.target_global_batch, training.world_size) == (2048, 4, 1)
    assert (training.precision, training.weights) == (Precision.BF16, WeightsDtype.BF16)
    assert training.tf32 is False
    assert training.optimizer is OptimizerName.ADAMW_8BIT  # adamw_8bit: bitsandbytes'
    assert training.lora is not None
    assert (training.lora.r, training.lora.alpha, training.lora.dropout) == (16, 32.0, 0.05)
    assert training.lora.target_modules == [
        "gate_proj",
        "down_proj",
        "up_proj",
        "q_proj",
        "v_proj",
        "k_proj",
        "o_proj",
    ]
    named = {note.split(":")[0] for note in converted.unmapped}
    # Set in the file, changes memory, not modelled: each named.
    assert {"attn_implementation", "bf16", "optimizer"} <= named
    # Irrelevant to memory (datasets, learning rate, logging): not listed.
    assert not named & {"datasets", "learning_rate", "logging_steps", "wandb_project"}


def test_the_qwen_lora_example() -> None:
    converted = load_training_file(AXOLOTL_EXAMPLES / "qwen3-8b-lora-fused-attn.yaml")
    spec = converted.spec
    assert spec.model.hf_id == "Qwen/Qwen3-8B"
    training = spec.training
    assert (training.seq_len, training.target_global_batch) == (4096, 4)
    assert training.optimizer is OptimizerName.ADAMW  # adamw_torch_fused
    assert training.lora is not None
    assert training.lora.target_modules == "all-linear"  # lora_target_linear: true
    assert (training.lora.r, training.lora.alpha, training.lora.dropout) == (32, 64.0, 0.0)
    named = {note.split(":")[0] for note in converted.unmapped}
    assert {"fused_attn_kernel", "flash_attention"} <= named


@pytest.mark.parametrize("name", ["llama-3-qlora-1b.yml", "qwen3-32b-qlora.yaml"])
def test_qlora_examples_are_refused_naming_the_adapter(name: str) -> None:
    with pytest.raises(
        SpecError,
        match=r"qlora-?\w*\.ya?ml: adapter: qlora trains adapters on "
        r"a 4-bit base, which autotune does not model",
    ) as refused:
        load_training_file(AXOLOTL_EXAMPLES / name)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("load_in_8bit: true\n", "load_in_8bit: a quantized base"),
        ("optimizer: lion_8bit\n", "optimizer: 'lion_8bit': autotune models adamw_torch"),
        ("adapter: llama-adapter\n", "adapter: 'llama-adapter': autotune models lora"),
        ("micro_batch_size: auto\n", "micro_batch_size: 'auto': a number of samples"),
        ("sequence_len: 0\n", "sequence_len: 0: a number of samples"),
    ],
)
def test_what_cannot_be_modelled_is_refused_by_name(
    tmp_path: Path, extra: str, field: str
) -> None:
    config = tmp_path / "axolotl.yml"
    config.write_text("base_model: org/model\n" + extra)
    with pytest.raises(SpecError, match=f"axolotl.yml: {field}"):
        load_training_file(config)


def test_model_replaces_base_model_with_a_local_directory(tmp_path: Path) -> None:
    directory = tiny_llama_directory(tmp_path)
    converted = load_training_file(AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml", model=str(directory))
    hf_config = converted.spec.model.hf_config
    assert hf_config is not None and hf_config["model_type"] == "llama"
    assert "_name_or_path" not in hf_config
    assert f"base_model: replaced by --model {directory}" in converted.unmapped


def test_a_local_directory_without_a_config_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "axolotl.yml"
    config.write_text(f"base_model: {tmp_path}\n")
    with pytest.raises(SpecError, match="base_model: .* a directory without config.json"):
        load_training_file(config)


def test_a_spec_is_still_a_spec(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: gpt2-tiny}\ntraining: {seq_len: 32}\n")
    converted = load_training_file(spec)
    assert converted.format is ConfigFormat.SPEC and converted.unmapped == ()
    with pytest.raises(SpecError, match="--model: the spec says it"):
        load_training_file(spec, model="org/model")
