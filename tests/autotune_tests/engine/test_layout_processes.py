"""Layouts tuned side by side (autotune/engine/layout_processes.py): an estimate's `sharding:
auto` tune with its layouts in forked child processes answers what the same tune one layout at
a time answers, reports the same progress in the caller's process, raises a child's error as
the child raised it, and stops, saying so, when a child dies."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from autotune.core.errors import SpecError
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.parallel.layout_choice import LAYOUT_NAMES
from autotune.core.schemas import Sharding, Spec, StepOutcome, Trial
from autotune.engine.estimate import EstimateRunner
from autotune.engine.layout_tuning import tune_layouts
from autotune.engine.probe import FitTracer
from autotune.engine.runner import TrialRunner
from tests.api_tests.factories import AUTO_LAYOUT_SPEC

SPEC = AUTO_LAYOUT_SPEC  # every layout fits: each is tuned and ranked


def _open_layout(spec: Spec) -> tuple[TrialRunner, FitTracer | None]:
    return EstimateRunner(spec, gpu=budget_for(find_gpu("H100 80GB"), 2)), None


class _Progress:
    """What a tune reports, in the caller's process."""

    def __init__(self) -> None:
        self.layouts: list[tuple[Sharding, int, int]] = []
        self.phases: list[str] = []
        self.attempts: list[tuple[bool, int, bool, int]] = []
        self.trials: list[tuple[int, int, bool]] = []
        self.pid = os.getpid()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_layout": self.on_layout,
            "on_phase": self.on_phase,
            "on_attempt": self.on_attempt,
            "on_trial": self.on_trial,
        }

    def on_layout(self, sharding: Sharding, index: int, count: int) -> None:
        assert os.getpid() == self.pid
        self.layouts.append((sharding, index, count))

    def on_phase(self, text: str, planned: int | None) -> None:
        assert os.getpid() == self.pid
        self.phases.append(text)

    def on_attempt(self, checkpointing: bool, outcome: StepOutcome) -> None:
        assert os.getpid() == self.pid
        self.attempts.append(
            (checkpointing, outcome.micro_batch, outcome.fits, outcome.peak_bytes)
        )

    def on_trial(self, trial: Trial) -> None:
        assert os.getpid() == self.pid
        self.trials.append((trial.micro_batch, trial.accumulation_steps, trial.checkpointing))


def _tune(tmp_path: Path, name: str, processes: int, progress: _Progress, opener: Any) -> Any:
    return tune_layouts(
        SPEC,
        opener,
        storage_url=f"sqlite:///{tmp_path / name}",
        study_name="side-by-side",
        processes=processes,
        **progress.callbacks(),
    )


@pytest.mark.e2e
def test_layouts_side_by_side_answer_as_one_at_a_time(tmp_path: Path) -> None:
    alone, side = _Progress(), _Progress()
    one_at_a_time = _tune(tmp_path, "alone.db", 1, alone, _open_layout)
    side_by_side = _tune(tmp_path, "side.db", 2, side, _open_layout)
    assert side_by_side.model_dump() == one_at_a_time.model_dump()
    assert len(side_by_side.layouts) == 4
    # The same progress, reported here: every layout once, the same attempts and trials.
    assert sorted(side.layouts) == sorted(alone.layouts)
    # The longest first: FSDP2's two layouts start the two processes, DDP's follow.
    assert [sharding for sharding, _, _ in alone.layouts][:2] == [Sharding.NONE, Sharding.ZERO1]
    assert {sharding for sharding, _, _ in side.layouts[:2]} == {Sharding.ZERO2, Sharding.ZERO3}
    assert Counter(side.attempts) == Counter(alone.attempts)
    assert Counter(side.trials) == Counter(alone.trials)
    # Every phase names its layout (interleaved lines say whose they are).
    names = tuple(LAYOUT_NAMES[sharding] for sharding, _, _ in side.layouts)
    assert side.phases and all(phase.startswith(names) for phase in side.phases)
    assert not multiprocessing.active_children()


def test_an_error_in_a_layout_s_process_is_raised_as_it_raised_it(tmp_path: Path) -> None:
    def opener(spec: Spec) -> tuple[TrialRunner, FitTracer | None]:
        raise SpecError(f"no runner for {spec.training.sharding.value}")

    with pytest.raises(SpecError, match=r"^no runner for (none|zero1|zero2|zero3)$"):
        _tune(tmp_path, "error.db", 2, _Progress(), opener)
    assert not multiprocessing.active_children()


def test_a_layout_s_process_that_dies_stops_the_tune_saying_so(tmp_path: Path) -> None:
    def opener(spec: Spec) -> tuple[TrialRunner, FitTracer | None]:
        os._exit(3)  # as the kernel's out-of-memory killer would end it: nothing said

    with pytest.raises(RuntimeError, match="a layout's process died before its tune ended"):
        _tune(tmp_path, "died.db", 2, _Progress(), opener)
    assert not multiprocessing.active_children()


def test_fewer_than_one_process_is_refused(tmp_path: Path) -> None:
    from autotune.engine.layout_processes import LayoutJob, TuneOptions, tune_side_by_side

    options = TuneOptions(f"sqlite:///{tmp_path / 'refused.db'}", None, 0, 1.0)
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        tune_side_by_side([LayoutJob(0, SPEC, "refused")], _open_layout, options, processes=0)
