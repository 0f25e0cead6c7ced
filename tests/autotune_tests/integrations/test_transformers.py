"""`tuned_arguments` with a real `Trainer`: the tuned arguments keep the global batch asked for
and train (autotune/integrations/transformers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotune.core.errors import SpecError
from autotune.integrations.transformers import longest_samples, tuned_arguments
from tests.autotune_tests.core.exports.roundtrip import tiny_llama

SEQ_LEN = 32
MEMORY_BYTES = 64 * 2**20


def rows(count: int, length: int = SEQ_LEN) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 256, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def test_the_longest_samples_come_first() -> None:
    dataset = [{"input_ids": [0] * n} for n in (3, 9, 1, 7)]
    assert [len(s["input_ids"]) for s in longest_samples(dataset, 2)] == [9, 7]
    with pytest.raises(SpecError, match="train_dataset: empty"):
        longest_samples([], 2)


@pytest.mark.e2e
def test_a_trainer_trains_with_the_tuned_arguments(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        optim="adamw_torch",
    )
    model = tiny_llama()
    dataset = rows(16)
    tuned = tuned_arguments(
        model, args, dataset, memory=MEMORY_BYTES, trials=2, seconds_per_trial=0.05
    )
    # The global batch asked for, kept exactly; the rest of the arguments as they were.
    assert tuned.per_device_train_batch_size * tuned.gradient_accumulation_steps == 8
    assert (tuned.max_steps, tuned.optim, tuned.output_dir) == (2, args.optim, args.output_dir)
    trainer = Trainer(model=model, args=tuned, train_dataset=dataset)
    trainer.train()
    assert trainer.state.global_step == 2
