"""Progress of long commands (autotune/cli/progress.py): a spinner for the trial under way on a
terminal, plain stamped lines when piped, "trial i of N" while within the plan."""

from __future__ import annotations

import io
import re

from rich.console import Console

from autotune.cli.progress import Progress
from autotune.core.schemas import StepKind
from tests.api_tests.factories import trial


def test_piped_every_start_is_a_plain_stamped_line() -> None:
    out = io.StringIO()
    progress = Progress(Console(file=out, width=200))
    progress.phase("measure: 3 of 9 configurations, timed", 3)
    progress.starting("trial 1 of 3: micro-batch 8 x 4 steps, checkpointing off: timing")
    progress.trial(trial(0))
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\[0:00\] measure: 3 of 9 configurations, timed", lines[0])
    assert lines[1].endswith("checkpointing off: timing ...")
    assert re.match(r"\[0:00\] trial 1 of 3: micro-batch    8 x   4 steps", lines[2])


def test_on_a_terminal_the_trial_under_way_is_a_spinner_not_a_line() -> None:
    out = io.StringIO()
    progress = Progress(Console(file=out, width=200, force_terminal=True))
    progress.starting("checkpointing off: micro-batch 28")
    assert progress._status is not None  # a live status line, redrawn in place
    progress.close()
    assert progress._status is None


def test_past_the_plan_a_trial_is_counted_without_a_total() -> None:
    progress = Progress(Console(file=io.StringIO()))
    progress.phase("measure", 2)
    assert progress.trial_label(1) == "trial 2 of 2"
    assert progress.trial_label(2) == "trial 3"  # partial checkpointing's refinements


def test_each_kind_of_step_is_announced_by_its_own_words() -> None:
    out = io.StringIO()
    progress = Progress(Console(file=out, width=200))
    progress.phase("measure", 1)
    progress.step_starting(StepKind.WARM_UP, 1, 1, False)
    progress.step_starting(StepKind.TRIAL, 12, 1, True)
    progress.step_starting(StepKind.MEASURE, 8, 4, False)
    lines = out.getvalue().splitlines()[1:]
    assert lines[0].endswith("warm-up, checkpointing off: micro-batch 1 ...")
    assert lines[1].endswith("step, checkpointing on: micro-batch 12 ...")
    assert lines[2].endswith(
        "trial 1 of 1: micro-batch 8 x 4 steps, checkpointing off: timing ..."
    )
