"""A recommendation written back into real files: only its keys change (the diff says so, the
comments and key order stay), and each consumer still accepts the file: Axolotl's own schema,
transformers' `TrainingArguments`, DeepSpeed's `DeepSpeedConfig`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autotune.core.configs import Converted, load_training_file
from autotune.core.configs.writeback import recommended_settings, rewritten, unified_diff
from autotune.core.exports import build_exports
from autotune.core.schemas import Exports, Recommendation
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES
from tests.autotune_tests.core.configs.test_deepspeed import ZERO2, written
from tests.autotune_tests.core.configs.test_hf_args import saved_arguments


def recommendation(
    converted: Converted, micro_batch: int, *, checkpointing: bool, blocks: int | None = None
) -> tuple[Recommendation, Exports]:
    training = converted.spec.training
    target = training.required_target_global_batch()
    rec = Recommendation(
        micro_batch=micro_batch,
        accumulation_steps=target // (micro_batch * training.world_size),
        checkpointing=checkpointing,
        checkpointed_blocks=blocks,
        num_blocks=None if blocks is None else 2 * blocks,
        world_size=training.world_size,
        global_batch=target,
        samples_per_s=10.0,
        peak_bytes=1,
        capacity_bytes=2,
    )
    exports = build_exports(rec, token_model=True, transformers_version=None, training=training)
    return rec, exports


def changed_lines(before: str, after: str) -> list[str]:
    diff = unified_diff(before, after, "file").splitlines()
    return [line for line in diff[2:] if line[:1] in "+-"]


@pytest.mark.parametrize("name", ["llama-3-lora-1b.yml", "qwen3-8b-lora-fused-attn.yaml"])
def test_an_axolotl_example_keeps_everything_but_the_recommended_keys(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    shutil.copy(AXOLOTL_EXAMPLES / name, path)
    converted = load_training_file(path)
    rec, exports = recommendation(converted, 4, checkpointing=False)
    before = path.read_text()
    settings, notes = recommended_settings(converted, rec, exports)
    after = rewritten(converted, before, settings)
    old_micro = converted.data["micro_batch_size"]
    old_accumulation = converted.data["gradient_accumulation_steps"]
    assert sorted(changed_lines(before, after)) == sorted(
        [
            f"-gradient_accumulation_steps: {old_accumulation}",
            "+gradient_accumulation_steps: 1",
            f"-micro_batch_size: {old_micro}",
            "+micro_batch_size: 4",
            "-gradient_checkpointing: true",
            "+gradient_checkpointing: false",
        ]
    )
    assert notes == []
    validated = axolotl_validated(after)
    assert (validated.micro_batch_size, validated.gradient_accumulation_steps) == (4, 1)
    assert validated.gradient_checkpointing is False


def axolotl_validated(text: str) -> object:
    pytest.importorskip("axolotl", reason="make env installs Axolotl's schema (no-deps)")
    import yaml
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    return validate_config(DictDefault(yaml.safe_load(text)))


def test_partial_checkpointing_is_written_as_the_flag_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "lora.yml"
    shutil.copy(AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml", path)
    converted = load_training_file(path)
    rec, exports = recommendation(converted, 2, checkpointing=True, blocks=1)
    settings, notes = recommended_settings(converted, rec, exports)
    assert settings["gradient_checkpointing"] is True
    assert notes and "first 1 blocks" in notes[0]


def test_a_training_arguments_file_still_builds_its_arguments(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    path = saved_arguments(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8)
    converted = load_training_file(path, model="org/model", seq_len=32)
    rec, exports = recommendation(converted, 8, checkpointing=True)
    before = path.read_text()
    after = rewritten(converted, before, recommended_settings(converted, rec, exports)[0])
    assert sorted(changed_lines(before, after)) == sorted(
        [
            '-  "gradient_accumulation_steps": 8,',
            '+  "gradient_accumulation_steps": 2,',
            '-  "gradient_checkpointing": false,',
            '+  "gradient_checkpointing": true,',
            '-  "activation_checkpointing": false,',
            '+  "activation_checkpointing": true,',
            '-  "per_device_train_batch_size": 2,',
            '+  "per_device_train_batch_size": 8,',
        ]
    )
    args = TrainingArguments(**json.loads(after))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 2)
    assert args.activation_checkpointing is True


def test_a_deepspeed_file_still_reads_as_a_config(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from tests.autotune_tests.core.exports.consumers import deepspeed_properties

    path = written(tmp_path, ZERO2)
    converted = load_training_file(path, model="org/model", seq_len=32)
    rec, exports = recommendation(converted, 8, checkpointing=True)
    before = path.read_text()
    settings, notes = recommended_settings(converted, rec, exports)
    after = rewritten(converted, before, settings)
    assert sorted(changed_lines(before, after)) == sorted(
        [
            '-    "train_micro_batch_size_per_gpu": 4,',
            '+    "train_micro_batch_size_per_gpu": 8,',
            '-    "gradient_accumulation_steps": 2,',
            '+    "gradient_accumulation_steps": 1,',
        ]
    )
    assert "DeepSpeed config cannot say" in notes[0]
    parsed = deepspeed_properties(json.loads(after), world_size=8)
    assert (parsed["micro_batch"], parsed["accumulation"], parsed["world_size"]) == (8, 1, 8)
    assert parsed["zero_stage"] == 2
