"""A `TrainingArguments` JSON as transformers itself writes it, read as a spec, with its
DeepSpeed or FSDP layout over the ranks the options give."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.configs import ConfigFormat, RankOptions, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, Sharding, WeightsDtype
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES, tiny_llama_directory


def saved_arguments(tmp_path: Path, **arguments: object) -> Path:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **arguments)
    path = tmp_path / "training_args.json"
    path.write_text(args.to_json_string())
    return path


def test_the_trainers_own_file(tmp_path: Path) -> None:
    path = saved_arguments(
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=8,
        bf16=True,
        optim="sgd",
    )
    directory = tiny_llama_directory(tmp_path)
    converted = load_training_file(path, model=str(directory), seq_len=32)
    assert converted.format is ConfigFormat.HF_ARGS
    training = converted.spec.training
    assert (training.target_global_batch, training.seq_len) == (32, 32)
    # TrainingArguments' bf16 is autocast: the weights stay as loaded.
    assert (training.precision, training.weights) == (Precision.BF16, WeightsDtype.FP32)
    assert training.optimizer is OptimizerName.SGD


@pytest.mark.parametrize(
    ("model", "seq_len", "field"),
    [
        (None, 32, "--model: a TrainingArguments file names no model"),
        ("org/model", None, "--seq-len: a TrainingArguments file has no sequence length"),
    ],
)
def test_model_and_sequence_length_are_required(
    tmp_path: Path, model: str | None, seq_len: int | None, field: str
) -> None:
    path = saved_arguments(tmp_path)
    with pytest.raises(SpecError, match=f"training_args.json: {field}"):
        load_training_file(path, model=model, seq_len=seq_len)


def test_an_optimizer_without_a_model_is_refused(tmp_path: Path) -> None:
    path = saved_arguments(tmp_path, optim="lion_32bit")
    with pytest.raises(SpecError, match="optim: 'lion_32bit': autotune models"):
        load_training_file(path, model="org/model", seq_len=32)


# ---------------------------------------------------------------------------------------------
# Ranks and layout: the launcher's ranks from the options, the layout from the arguments.


def test_a_deepspeed_path_with_the_ranks_from_the_options(tmp_path: Path) -> None:
    # Axolotl's own zero2.json ("auto" batch values: the Trainer fills them in).
    ds_config = AXOLOTL_EXAMPLES / "deepspeed_configs" / "zero2.json"
    path = saved_arguments(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        deepspeed=str(ds_config),
    )
    alone = load_training_file(path, model="org/model", seq_len=32)
    assert (alone.spec.training.world_size, alone.spec.training.sharding) == (1, Sharding.NONE)
    assert alone.layout is Sharding.ZERO2
    converted = load_training_file(
        path, model="org/model", seq_len=32, ranks=RankOptions(world_size=4)
    )
    training = converted.spec.training
    assert (training.world_size, training.sharding) == (4, Sharding.ZERO2)
    assert training.target_global_batch == 2 * 4 * 4
    assert any("offload_optimizer: offloading not modelled" in note for note in converted.unmapped)


@pytest.mark.parametrize(
    ("fsdp", "fsdp_config", "sharding"),
    [
        ("full_shard auto_wrap", None, Sharding.ZERO3),
        ("shard_grad_op", None, Sharding.ZERO2),
        (True, {"version": 2, "reshard_after_forward": False}, Sharding.ZERO2),
    ],
)
def test_fsdp_as_transformers_saves_it(
    tmp_path: Path, fsdp: object, fsdp_config: dict[str, object] | None, sharding: Sharding
) -> None:
    path = saved_arguments(tmp_path, fsdp=fsdp, fsdp_config=fsdp_config)
    converted = load_training_file(
        path, model="org/model", seq_len=32, ranks=RankOptions(world_size=8)
    )
    assert converted.spec.training.sharding is sharding
    assert not any("FSDP1" in note for note in converted.unmapped)  # transformers 5: FSDP2


def test_fsdp1_hybrid_shard_shards_within_the_nodes(tmp_path: Path) -> None:
    path = saved_arguments(tmp_path, fsdp="hybrid_shard auto_wrap", fsdp_config={"version": 1})
    with pytest.raises(SpecError, match="fsdp: hybrid sharding shards within each node"):
        load_training_file(path, model="org/model", seq_len=32, ranks=RankOptions(world_size=16))
    converted = load_training_file(
        path, model="org/model", seq_len=32, ranks=RankOptions(nodes=2, gpus_per_node=8)
    )
    training = converted.spec.training
    assert (training.sharding, training.shard_group_size, training.world_size) == (
        Sharding.HYBRID,
        8,
        16,
    )
    assert "fsdp: FSDP1 measured as FSDP2 (per-parameter shards)" in converted.unmapped
