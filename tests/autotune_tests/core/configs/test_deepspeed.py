"""A DeepSpeed JSON read as a spec: batch arithmetic, ZeRO stage, precision, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autotune.core.configs import ConfigFormat, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, Sharding, WeightsDtype

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
    assert "zero_optimization.stage: 2 on one rank shards nothing" in converted.unmapped


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
