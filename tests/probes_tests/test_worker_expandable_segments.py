"""A worker evaluates each mode under expandable segments in trial children of their own, whose
CUDA (here the emulated GPU) starts with them, and its run's result carries the option; told
not to, it evaluates nothing. The worker runs in this process against the in-process app (real
SQLite store); its trials run in real child processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.schemas import Spec
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EmulatedTarget, RunStatus
from probes.inventory import read_inventory
from probes.worker import RunOutcome, Worker, WorkerConfig

pytestmark = pytest.mark.slow

MIB = 2**20
# gpt2-tiny on 152 MiB: the default allocator stops at 14 samples where expandable segments fit
# 17 (tests/autotune_tests/cli/test_main.py shows the same through `autotune probe`).
MEMORY_BYTES = 152 * MIB


def _spec(max_micro_batch: int) -> Spec:
    return Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 32, "max_micro_batch": max_micro_batch},
        }
    )


def _worker(client: ServerClient, tmp_path: Path, *, expandable_segments: bool) -> Worker:
    config = WorkerConfig(
        worker_id=f"expandable-{expandable_segments}",
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}",
        start_method="forkserver",
        expandable_segments=expandable_segments,
    )
    return Worker(client, read_inventory("cpu", MEMORY_BYTES), config)


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
