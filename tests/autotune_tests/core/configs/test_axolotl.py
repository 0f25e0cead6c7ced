"""Axolotl example configs of a current release (tests/data/axolotl/SOURCE.md), read as specs:
what maps, what is named as not mapped, the quantized bases refused by name, and the ranks and
layout of the multi-GPU examples (DeepSpeed paths, FSDP1 and FSDP2, dp_shard_size)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.core.configs import ConfigFormat, Converted, RankOptions, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, Sharding, TrainingSpec, WeightsDtype
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


# ---------------------------------------------------------------------------------------------
# Ranks and layout: the multi-GPU examples (tests/data/axolotl/SOURCE.md).


def ranks_and_layout(name: str, **options: object) -> tuple[TrainingSpec, Converted]:
    converted = load_training_file(AXOLOTL_EXAMPLES / name, ranks=RankOptions(**options))  # type: ignore[arg-type]
    return converted.spec.training, converted


def test_a_deepspeed_path_is_read_for_its_stage_and_ray_says_the_ranks() -> None:
    # deepspeed: deepspeed_configs/zero3.json (Axolotl's own file, next to the example here);
    # use_ray with ray_num_workers: 4, one GPU each.
    training, converted = ranks_and_layout("llama-3-lora-1b-ray.yml")
    assert (training.world_size, training.sharding) == (4, Sharding.ZERO3)
    assert training.target_global_batch == 2 * 2 * 4  # micro x accumulation x ranks
    assert converted.layout is Sharding.ZERO3
    assert not any(note.startswith(("ranks:", "deepspeed:")) for note in converted.unmapped)
    with pytest.raises(SpecError, match="ray_num_workers: 4 ranks, but the options say 8"):
        ranks_and_layout("llama-3-lora-1b-ray.yml", world_size=8)


def test_a_deepspeed_path_that_is_not_here_is_read_by_axolotls_name(tmp_path: Path) -> None:
    config = tmp_path / "reward.yaml"
    shutil.copy(AXOLOTL_EXAMPLES / "qwen3-reward-model.yaml", config)  # zero1.json, not here
    converted = load_training_file(config, ranks=RankOptions(world_size=2))
    assert converted.spec.training.sharding is Sharding.ZERO1
    assert (
        "deepspeed: deepspeed_configs/zero1.json is not here; ZeRO stage 1 read from its name"
        in converted.unmapped
    )
    config.write_text(config.read_text().replace("zero1.json", "mine.json"))
    with pytest.raises(SpecError, match="deepspeed: deepspeed_configs/mine.json: no such file"):
        load_training_file(config, ranks=RankOptions(world_size=2))


def test_fsdp1_words_with_the_ranks_from_the_options() -> None:
    # fsdp: [full_shard, auto_wrap] and fsdp_config with the fsdp_ prefix, offloading.
    training, converted = ranks_and_layout("llama-3-fft-8b-liger-fsdp.yaml", world_size=8)
    assert (training.world_size, training.sharding) == (8, Sharding.ZERO3)
    assert training.target_global_batch == 2 * 4 * 8
    assert {
        "fsdp_config: FSDP1 measured as FSDP2 (per-parameter shards)",
        "fsdp_config: parameter offloading not modelled (all on the GPU)",
    } <= set(converted.unmapped)


def test_without_the_ranks_the_file_is_sized_for_one_gpu_and_says_how_to_give_them() -> None:
    training, converted = ranks_and_layout("llama-3-fft-8b-liger-fsdp.yaml")
    assert (training.world_size, training.sharding, training.target_global_batch) == (
        1,
        Sharding.NONE,
        8,
    )
    assert converted.layout is Sharding.ZERO3  # what the file says, for the write-back
    hint = "the file does not say how many; --world-size or --nodes x --gpus-per-node"
    assert f"ranks: 1 ({hint})" in converted.unmapped
    assert "fsdp_config: zero3 on one rank shards nothing" in converted.unmapped


@pytest.mark.parametrize(
    ("name", "reshard"),
    [("llama-3-3b-fp8-fsdp2.yaml", True), ("qwen2-adamw-pretrain-fsdp2.yaml", True)],
)
def test_fsdp2_configs_over_nodes(name: str, reshard: bool) -> None:
    training, _ = ranks_and_layout(name, nodes=2, gpus_per_node=4)
    assert (training.world_size, training.nodes, training.gpus_per_node) == (8, 2, 4)
    assert training.sharding is (Sharding.ZERO3 if reshard else Sharding.ZERO2)


def test_reshard_after_forward_false_is_zero2(tmp_path: Path) -> None:
    config = tmp_path / "fsdp2.yaml"
    text = (AXOLOTL_EXAMPLES / "llama-3-3b-fp8-fsdp2.yaml").read_text()
    config.write_text(text.replace("reshard_after_forward: true", "reshard_after_forward: false"))
    converted = load_training_file(config, ranks=RankOptions(world_size=4))
    assert converted.spec.training.sharding is Sharding.ZERO2


def test_dp_shard_size_says_the_ranks_and_below_them_the_hybrid_groups() -> None:
    # dp_shard_size: 16 ("requires 2x8xH100 nodes"), FSDP2 full shard.
    training, _ = ranks_and_layout("gpt-oss-120b-fft-fsdp2-offload.yaml")
    assert (training.world_size, training.sharding) == (16, Sharding.ZERO3)
    training, _ = ranks_and_layout("gpt-oss-120b-fft-fsdp2-offload.yaml", world_size=32)
    assert (training.world_size, training.sharding, training.shard_group_size) == (
        32,
        Sharding.HYBRID,
        16,
    )
    assert training.target_global_batch == 1 * 2 * 32
    with pytest.raises(SpecError, match="dp_shard_size: 16 is more than the 8 ranks"):
        ranks_and_layout("gpt-oss-120b-fft-fsdp2-offload.yaml", world_size=8)


def test_tensor_parallelism_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match="tensor_parallel_size: 2: splitting the model across"):
        ranks_and_layout("llama-3_1-8b-hsdp-tp.yaml")


def test_sharding_auto_replaces_the_files_layout() -> None:
    training, converted = ranks_and_layout(
        "llama-3-lora-1b.yml", world_size=4, sharding=Sharding.AUTO
    )
    assert (training.world_size, training.sharding) == (4, Sharding.AUTO)
    assert "layout: none replaced by --sharding auto" in converted.unmapped


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodes": 2}, "--nodes: needs --gpus-per-node"),
        ({"world_size": 6, "nodes": 2, "gpus_per_node": 4}, "--world-size: 6, but --nodes x"),
    ],
)
def test_rank_options_that_say_no_world_size_are_refused(
    options: dict[str, int], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        ranks_and_layout("llama-3-lora-1b.yml", **options)


def test_a_spec_refuses_the_rank_options(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: gpt2-tiny}\ntraining: {seq_len: 32}\n")
    with pytest.raises(SpecError, match="--world-size: the spec says it"):
        load_training_file(spec, ranks=RankOptions(world_size=2))
