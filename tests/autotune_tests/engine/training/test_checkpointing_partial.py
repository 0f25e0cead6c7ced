"""Partial checkpointing: the first k of L blocks checkpointed. Between the plain and the fully
checkpointed maxima a micro-batch fits with k < L blocks at a fraction of the recompute, the
tuner finds the fewest such k, and the exports say how to set it."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from autotune.core.errors import SpecError
from autotune.core.schemas import Spec, TrainingSpec
from autotune.core.search.micro_batch import fewest_fitting
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.probe import probe
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.step import TrainingStep
from autotune.engine.tuner import tune
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG, tiny_lm

MiB = 2**20
CAPACITY_BYTES = 150 * MiB  # gpt2-tiny at 32 tokens: 14 without checkpointing, 21 with


def _spec(**training: object) -> Spec:
    return Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 32, "max_micro_batch": 64, **training},
        }
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_a_micro_batch_between_the_two_modes_fits_with_some_blocks_checkpointed() -> None:
    spec = _spec()
    plain, full = (m.max_micro_batch for m in probe(spec, EmulatedDevice(CAPACITY_BYTES)).modes)
    assert 1 <= plain < full
    runner = InProcessRunner(spec, EmulatedDevice(CAPACITY_BYTES))
    assert runner.warm_up().fits
    blocks = runner.num_blocks
    assert blocks == 4

    def fits(micro_batch: int, count: int) -> bool:
        return runner.trial(micro_batch, checkpointing=True, checkpointed_blocks=count).fits

    found = []
    for micro_batch in (plain + 1, full):  # the ends of the gap
        assert not runner.trial(micro_batch).fits  # beyond the plain maximum
        count = fewest_fitting(lambda k, b=micro_batch: fits(b, k), failing=0, fitting=blocks)
        assert fits(micro_batch, count)
        if count > 1:
            assert not fits(micro_batch, count - 1)  # the fewest
        found.append((micro_batch, count))
    # Fewer blocks suffice for the smaller micro-batch: k grows with b.
    (_, fewer), (_, more) = found
    assert fewer <= more and fewer < blocks


@pytest.mark.e2e
def test_more_checkpointed_blocks_keep_less_and_recompute_more() -> None:
    runner = InProcessRunner(_spec(), EmulatedDevice(2**40))
    assert runner.warm_up().fits
    # At 16 samples the peak is in backward (at 8, in the optimizer step, the same for all k).
    peaks = [runner.trial(16).peak_allocated_bytes]
    calls: list[int] = []
    # A module inside block 0: called again when the block recomputes in backward.
    handle = runner.workload.model.layers[0].ln_1.register_forward_hook(lambda *_: calls.append(1))
    try:
        for count in range(1, 5):
            calls.clear()
            outcome = runner.trial(16, checkpointing=True, checkpointed_blocks=count)
            peaks.append(outcome.peak_allocated_bytes)
            assert len(calls) == 2  # block 0 is checkpointed: run again in backward
        calls.clear()
        runner.trial(16)
        assert len(calls) == 1
    finally:
        handle.remove()
    assert all(a is not None and b is not None and a > b for a, b in itertools.pairwise(peaks))


def test_a_hugging_face_model_checkpoints_its_first_layers() -> None:
    pytest.importorskip("transformers")
    spec = Spec.model_validate(
        {
            "model": {"hf_config": {**TINY_LLAMA_CONFIG, "num_hidden_layers": 3}},
            "training": {"seq_len": 32},
        }
    )
    runner = InProcessRunner(spec, EmulatedDevice(2**40))
    assert runner.num_blocks == 3
    assert runner.trial(4, checkpointing=True, checkpointed_blocks=1).fits
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m for m in runner.workload.model.modules() if isinstance(m, GradientCheckpointingLayer)
    ]
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, False]
    assert runner.trial(4, checkpointing=True).fits  # all of them again
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, True]


def test_a_model_without_blocks_to_choose_refuses_a_count() -> None:
    training = TrainingSpec(seq_len=8)
    all_or_nothing = dataclasses.replace(tiny_lm(training), set_checkpointing=lambda on: None)
    step = TrainingStep(all_or_nothing, training, torch.device("cpu"))
    assert step.num_blocks is None
    with pytest.raises(SpecError, match="checkpoints all of its blocks or none"):
        step.checkpoint_blocks(1)
    with pytest.raises(ValueError, match="checkpointed blocks must be in"):
        InProcessRunner(_spec(), EmulatedDevice(2**40)).trial(
            2, checkpointing=True, checkpointed_blocks=5
        )


@pytest.mark.e2e
@pytest.mark.slow
def test_the_tuner_checkpoints_the_fewest_blocks_that_fit(tmp_path: Path) -> None:
    # 16 samples per step: 16 x 1 fits only checkpointed (plain stops at 14).
    spec = _spec(target_global_batch=16, headroom=0.0)
    result = tune(
        spec,
        EmulatedDevice(CAPACITY_BYTES),
        storage_url=f"sqlite:///{tmp_path / 'tune.db'}",
        target_seconds=0.05,
        n_trials=3,
    )
    partial = [t for t in result.trials if t.checkpointed_blocks is not None]
    assert partial, "no checkpointed candidate beyond the plain maximum"
    for trial in partial:
        assert trial.checkpointing and trial.checkpointed_blocks is not None
        assert 1 <= trial.checkpointed_blocks < 4
        # The fewest: one block fewer does not fit that step.
        fresh = InProcessRunner(spec, EmulatedDevice(CAPACITY_BYTES))
        assert fresh.warm_up().fits
        steps = min(trial.accumulation_steps, 2)
        assert fresh.trial(
            trial.micro_batch,
            steps,
            checkpointing=True,
            checkpointed_blocks=trial.checkpointed_blocks,
        ).fits
        if trial.checkpointed_blocks > 1:
            assert not fresh.trial(
                trial.micro_batch,
                steps,
                checkpointing=True,
                checkpointed_blocks=trial.checkpointed_blocks - 1,
            ).fits
    rec = result.recommendation
    assert rec is not None and result.exports is not None
    if rec.checkpointed_blocks is not None:
        assert rec.num_blocks == 4
        assert result.exports.checkpointed_blocks == rec.checkpointed_blocks
        loop_blocks = list(range(rec.checkpointed_blocks))
        assert (
            f"CHECKPOINT_BLOCKS: list[int] | None = {loop_blocks}\n" in result.exports.pytorch_loop
        )
