"""Throughput on an emulated named GPU (`autotune.engine.emulation.gpu_speed`): the tuner ranks by
that GPU's roofline, not by the host CPU's timing, and every device says where its samples/s come
from."""

from __future__ import annotations

import logging
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from autotune.cli.tune import print_tune_result
from autotune.core.schemas import SpeedSource
from autotune.core.tuning.throughput import speed_label
from autotune.engine.devices.device import EmulatedDevice, open_device
from autotune.engine.emulation.gpu_speed import RooflineTimedRunner, timed_on_its_gpu
from autotune.engine.estimate import EstimateRunner
from autotune.engine.fit_points import tracer_for
from autotune.engine.runner import InProcessRunner
from autotune.engine.tuner import tune_session
from tests.autotune_tests.engine.test_probe import preset_spec

MiB = 2**20


@pytest.mark.e2e
def test_a_named_gpu_s_tuning_is_ranked_by_its_roofline(tmp_path: Path) -> None:
    spec = preset_spec("gpt2-tiny", target_global_batch=16, max_micro_batch=16)
    runner = timed_on_its_gpu(InProcessRunner(spec, open_device("cpu", gpu="T4")))
    assert isinstance(runner, RooflineTimedRunner)
    result = tune_session(
        runner, storage_url=f"sqlite:///{tmp_path / 'study.db'}", n_trials=3, target_seconds=0.01
    )

    assert result.device.speed is SpeedSource.ROOFLINE
    assert speed_label(result.device) == "estimated for T4"
    assert any("speed estimated by roofline on T4" in a for a in result.device.assumptions)
    # Every measured configuration's samples/s is the traced step's roofline on the T4, and
    # its peak the real emulated step's: the same as an estimate's, whatever this CPU does.
    estimate = tracer_for(spec, result.device)
    assert isinstance(estimate, EstimateRunner) and estimate.gpu is not None
    assert estimate.warm_up(checkpointing=False).fits
    complete = [t for t in result.trials if t.samples_per_s is not None]
    assert len(complete) >= 2
    for trial in complete:
        step_time_s = estimate.step_time_s(
            trial.micro_batch, trial.accumulation_steps, checkpointing=trial.checkpointing
        )
        assert trial.step_time_s == step_time_s
        assert trial.samples_per_s == trial.micro_batch * trial.accumulation_steps / step_time_s
    rec = result.recommendation
    assert rec is not None
    assert rec.samples_per_s == max(t.samples_per_s or 0.0 for t in complete)
    # What `autotune tune` prints says so.
    out = StringIO()
    print_tune_result(Console(file=out, width=200), result)
    assert "samples/s per GPU (estimated for T4)" in out.getvalue()


def test_a_bare_size_is_timed_on_the_cpu_and_says_so() -> None:
    runner = InProcessRunner(preset_spec("cnn"), EmulatedDevice(64 * MiB))
    assert timed_on_its_gpu(runner) is runner
    assert runner.device_info.speed is SpeedSource.CPU_TIMING
    assert speed_label(runner.device_info) == "CPU timing, not a GPU's"


def test_a_step_that_cannot_be_traced_is_timed_on_the_cpu_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = InProcessRunner(preset_spec("cnn", precision="fp16"), open_device("cpu", gpu="T4"))
    with caplog.at_level(logging.WARNING, logger="autotune.engine.emulation.gpu_speed"):
        assert timed_on_its_gpu(runner) is runner
    assert "samples/s on T4 are CPU timings of the emulated step" in caplog.text
    assert "training.precision: fp16" in caplog.text
    assert runner.device_info.speed is SpeedSource.CPU_TIMING
