"""A worker evaluates each mode under expandable segments in trial children of their own, whose
CUDA (here the emulated GPU) starts with them, and its run's result carries the option; told
not to, it evaluates nothing; a tune that only they reach is measured and recommended under
them. The worker runs in this process against the in-process app (real SQLite store); its
trials run in real child processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.schemas import Spec, TrialState
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.runner import InProcessRunner
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EmulatedTarget, RunStatus
from probes.inventory import read_inventory
from probes.worker import RunOutcome, Worker, WorkerConfig

pytestmark = pytest.mark.slow

MIB = 2**20
# gpt2-tiny on 152 MiB: the default allocator stops at 14 samples where expandable segments fit
# 17 (tests/autotune_tests/cli/test_main.py shows the same through `autotune probe`).
MEMORY_BYTES = 152 * MIB


def _spec(max_micro_batch: int, **training: object) -> Spec:
    return Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 32, "max_micro_batch": max_micro_batch, **training},
        }
    )


def _worker(
    client: ServerClient,
    tmp_path: Path,
    *,
    expandable_segments: bool,
    memory_bytes: int = MEMORY_BYTES,
) -> Worker:
    config = WorkerConfig(
        worker_id=f"expandable-{expandable_segments}",
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}",
        start_method="forkserver",
        expandable_segments=expandable_segments,
    )
    return Worker(client, read_inventory("cpu", memory_bytes), config)


@pytest.mark.e2e
def test_a_workers_result_carries_expandable_segments_unless_told_not_to(
    user: ServerClient,
    worker: ServerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    target = EmulatedTarget(memory_bytes=MEMORY_BYTES)
    # A probe-only run (no target batch), without checkpointing's mode to keep it short.
    evaluated = user.submit_run(_spec(64), target).id
    assert _worker(worker, tmp_path, expandable_segments=True).run_once() is RunOutcome.SUCCEEDED
    run = user.get_run(evaluated)
    assert run.status is RunStatus.SUCCEEDED, run.error
    for mode in run.modes:
        option = mode.expandable_segments
        assert option is not None, mode.checkpointing
        assert option.allocator_conf == "expandable_segments:True"
        # Verified by real trials in children whose emulated GPU has expandable segments.
        assert option.trials >= 2 and option.recommended
        assert option.max_micro_batch is not None
        assert option.max_micro_batch > mode.max_micro_batch
    plain = next(m for m in run.modes if not m.checkpointing)
    assert plain.expandable_segments is not None
    assert (plain.max_micro_batch, plain.expandable_segments.max_micro_batch) == (14, 17)

    # Another spec (the same one would be answered from the first run's result).
    opted_out = user.submit_run(_spec(63), target).id
    assert _worker(worker, tmp_path, expandable_segments=False).run_once() is RunOutcome.SUCCEEDED
    run = user.get_run(opted_out)
    assert run.status is RunStatus.SUCCEEDED, run.error
    assert run.modes and all(m.expandable_segments is None for m in run.modes)


EXPANDABLE = "expandable_segments:True"
# gpt2-tiny (32 tokens, bf16) on 124 MiB, every byte usable: the default allocator fits 12
# samples per step in either mode and no accumulating step at all (with the gradients of a
# first micro-batch held, micro-batch 1 of the next runs out); under expandable segments 1 x 13
# fits in both (bench/results/estimator.md's gpt2-tiny rows;
# docs/design.md#expandable-segments-as-a-knob). So a target of 13 samples (a prime: 13 x 1
# or 1 x 13) is reached only under them.
ONLY_EXPANDABLE_BYTES = 124 * MIB
ONLY_EXPANDABLE_TARGET = 13


@pytest.mark.e2e
# Three minutes of trial children: on SQLite only. PostgreSQL stores the same fields of a
# result under expandable segments in test_a_workers_result_carries_expandable_segments.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_tune_only_expandable_segments_reach_is_measured_and_stored_under_them(
    user: ServerClient,
    worker: ServerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's tune: the trials that reach the target ran in children whose allocator had
    expandable segments from the start (each completed where the default allocator runs out,
    and reserved what an emulated GPU started with them reserves for that step), and the
    stored result says so: the trials', the recommendation's and the exports' allocator_conf."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    spec = _spec(64, precision="bf16", target_global_batch=ONLY_EXPANDABLE_TARGET, headroom=0.0)
    run_id = user.submit_run(spec, EmulatedTarget(memory_bytes=ONLY_EXPANDABLE_BYTES)).id
    tuner = _worker(worker, tmp_path, expandable_segments=True, memory_bytes=ONLY_EXPANDABLE_BYTES)
    assert tuner.run_once() is RunOutcome.SUCCEEDED
    run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    assert run.worker_device is not None and run.worker_device.allocator_conf is None

    under = [r.trial for r in run.trials if r.trial.allocator_conf is not None]
    assert under and all(t.allocator_conf == EXPANDABLE for t in under)
    reached = [t for t in under if t.micro_batch * t.accumulation_steps == ONLY_EXPANDABLE_TARGET]
    assert reached and all(t.state is TrialState.COMPLETE for t in reached)
    default = InProcessRunner(spec, EmulatedDevice(ONLY_EXPANDABLE_BYTES))
    expandable = InProcessRunner(
        spec, EmulatedDevice(ONLY_EXPANDABLE_BYTES, allocator_config=parse_alloc_conf(EXPANDABLE))
    )
    for trial in reached:
        size = (trial.micro_batch, trial.accumulation_steps)
        default.warm_up(checkpointing=trial.checkpointing)
        assert not default.trial(*size, checkpointing=trial.checkpointing).fits, trial
        expandable.warm_up(checkpointing=trial.checkpointing)
        step = expandable.trial(*size, checkpointing=trial.checkpointing)
        assert step.fits and step.peak_bytes == trial.peak_bytes, trial

    rec = run.recommendation
    assert rec is not None and rec.allocator_conf == EXPANDABLE
    assert rec.micro_batch * rec.accumulation_steps == ONLY_EXPANDABLE_TARGET
    mode = next(m for m in run.modes if m.checkpointing == rec.checkpointing)
    assert mode.expandable_segments is not None
    assert mode.expandable_segments.allocator_conf == EXPANDABLE
    assert run.exports is not None and run.exports.allocator_conf == EXPANDABLE
