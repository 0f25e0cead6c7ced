"""A `TrainingArguments` JSON as transformers itself writes it, read as a spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.configs import ConfigFormat, load_training_file
from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, WeightsDtype
from tests.autotune_tests.core.configs.models import tiny_llama_directory


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
