"""A DeepSpeed JSON read as a spec: batch arithmetic, ranks (the file's or the options'), ZeRO
stage, precision, refusals; Axolotl's shipped DeepSpeed configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autotune.core.configs import ConfigFormat, RankOptions, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, Sharding, WeightsDtype
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES

ZERO2 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def written(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config, indent=4))
    return path


def test_a_zero2_config(tmp_path: Path) -> None:
    converted = load_training_file(written(tmp_path, ZERO2), model="org/model", seq_len=128)
    assert converted.format is ConfigFormat.DEEPSPEED
    training = converted.spec.training
    assert (training.target_global_batch, training.world_size) == (64, 8)
    assert training.sharding is Sharding.ZERO2
    assert (training.precision, training.weights) == (Precision.BF16, WeightsDtype.BF16)
    assert training.optimizer is OptimizerName.ADAMW
    named = {note.split(":")[0] for note in converted.unmapped}
    assert {"bf16", "zero_optimization.offload_optimizer"} <= named


def test_zero_on_one_rank_shards_nothing(tmp_path: Path) -> None:
    config = {**ZERO2, "train_batch_size": 8}
    converted = load_training_file(written(tmp_path, config), model="org/model", seq_len=128)
    assert converted.spec.training.sharding is Sharding.NONE
    assert "zero_optimization.stage: zero2 on one rank shards nothing" in converted.unmapped


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu: 'auto'"),
        ({"train_batch_size": 60}, "train_batch_size: 60 is not"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type: 'Lamb'"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: 4"),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=f"ds_config.json: {field}"):
        load_training_file(written(tmp_path, {**ZERO2, **change}), model="org/m", seq_len=8)


def test_the_options_give_the_ranks_a_file_without_train_batch_size_lacks(
    tmp_path: Path,
) -> None:
    config = {key: value for key, value in ZERO2.items() if key != "train_batch_size"}
    path = written(tmp_path, config)
    alone = load_training_file(path, model="org/model", seq_len=128)
    assert (alone.spec.training.world_size, alone.spec.training.sharding) == (1, Sharding.NONE)
    converted = load_training_file(
        path, model="org/model", seq_len=128, ranks=RankOptions(nodes=2, gpus_per_node=4)
    )
    training = converted.spec.training
    assert (training.world_size, training.nodes, training.sharding) == (8, 2, Sharding.ZERO2)
    assert training.target_global_batch == 4 * 2 * 8


def test_options_that_disagree_with_train_batch_size_are_refused(tmp_path: Path) -> None:
    path = written(tmp_path, ZERO2)  # 64 = 4 x 2 x 8 ranks
    same = load_training_file(path, model="o/m", seq_len=8, ranks=RankOptions(world_size=8))
    assert same.spec.training.world_size == 8
    with pytest.raises(SpecError, match="train_batch_size: 8 ranks, but the options say 4"):
        load_training_file(path, model="o/m", seq_len=8, ranks=RankOptions(world_size=4))


@pytest.mark.parametrize(
    ("name", "sharding"),
    [
        ("zero1.json", Sharding.ZERO1),
        ("zero2.json", Sharding.ZERO2),
        ("zero3.json", Sharding.ZERO3),
    ],
)
def test_axolotls_deepspeed_configs_with_numbers_for_auto(
    tmp_path: Path, name: str, sharding: Sharding
) -> None:
    """Axolotl's shipped configs leave the batch to the Trainer ("auto"), which a DeepSpeed
    file read alone refuses; with numbers their stage is the layout."""
    config = json.loads((AXOLOTL_EXAMPLES / "deepspeed_configs" / name).read_text())
    with pytest.raises(SpecError, match="train_micro_batch_size_per_gpu: 'auto'"):
        load_training_file(written(tmp_path, config), model="o/m", seq_len=8)
    numbers = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}
    config.update(numbers, gradient_accumulation_steps=4)
    config["bf16"] = {"enabled": True}
    converted = load_training_file(written(tmp_path, config), model="o/m", seq_len=8)
    assert (converted.spec.training.world_size, converted.spec.training.sharding) == (4, sharding)
