"""What a long command shows while it works (`probe`, `tune`, `submit --wait`, `make run`): the
phase, each trial as it starts and ends ("trial i of N" where the plan is known) and the time
since the command started, on stderr. On a terminal the trial under way is a spinner line;
piped, every line is a plain line (a trial's start too, so a log never sits silent through a
trial of minutes). A run on a server is followed the same way from what its worker stores,
with a line every `QUIET_LINE_S` seconds while nothing new arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.status import Status

from autotune.core.bytesize import format_bytes
from autotune.core.schemas import StepKind, StepOutcome, Trial, TrialState
from autotune.remote.client import ServerClient
from autotune.remote.protocol import Run, RunStatus

if TYPE_CHECKING:
    from autotune.engine.runner import TrialRunner

# While a followed run shows nothing new, say that it is still there this often.
QUIET_LINE_S = 30.0
POLL_S = 1.0


def communication_split(trial: Trial) -> str:
    """An estimate's step with several ranks: its compute, its communication, and the part of
    that no compute hides, e.g. "compute 1.20 s + exposed 0.31 s of 2.05 s communication"."""
    if trial.compute_time_s is None or trial.communication_time_s is None:
        return "-"
    exposed_s = trial.exposed_communication_s or 0.0
    return (
        f"compute {format_seconds(trial.compute_time_s)} + exposed {format_seconds(exposed_s)} of "
        f"{format_seconds(trial.communication_time_s)} communication"
    )


def format_seconds(value_s: float) -> str:
    return f"{value_s:.3g} s" if value_s >= 0.1 else f"{value_s * 1e3:.3g} ms"


class Progress:
    """Progress lines on `console` (stderr), each stamped with the time since `started_s`."""

    def __init__(self, console: Console, *, speed: str | None = None) -> None:
        self.console = console
        self.speed = speed  # where samples/s come from (`speed_label`), shown beside them
        self.started_s = time.monotonic()
        self.planned_trials: int | None = None
        self._measured = 0  # measurements started
        self._status: Status | None = None

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started_s)
        hours, rest = divmod(seconds, 3600)
        return (
            f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
            if hours
            else f"{rest // 60}:{rest % 60:02d}"
        )

    def line(self, text: str) -> None:
        self._stop_status()
        self.console.print(f"[{self.elapsed()}] {text}", soft_wrap=True, highlight=False)

    def phase(self, text: str, planned_trials: int | None = None) -> None:
        if planned_trials is not None:
            self.planned_trials = planned_trials
        self.line(f"[bold]{text}[/bold]")

    def starting(self, text: str) -> None:
        """Work of unknown length begins: a spinner on a terminal, a plain line when piped."""
        if not self.console.is_terminal:
            self.line(f"{text} ...")
            return
        self._stop_status()
        self._status = self.console.status(f"{text} (started at {self.elapsed()})")
        self._status.start()

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def close(self) -> None:
        self._stop_status()

    def attempt(self, checkpointing: bool, attempt: StepOutcome) -> None:
        verdict = "[green]fits[/green]" if attempt.fits else "[red]OOM[/red] "
        where = f" in {attempt.oom_phase.value}" if attempt.oom_phase else ""
        mode = "on " if checkpointing else "off"
        allocated = attempt.peak_allocated_bytes
        held = "" if allocated is None else f" ({format_bytes(allocated)} allocated)"
        self.line(
            f"checkpointing {mode}  micro-batch {attempt.micro_batch:>5}"
            f"  {verdict}  peak {format_bytes(attempt.peak_bytes)} reserved{held}{where}"
        )
        if attempt.oom is not None:
            self.line(f"    {attempt.oom.summary()}")

    def trial_label(self, number: int) -> str:
        """`trial i of N` (from 1) while within the plan, `trial i` past it or without one."""
        ordinal = number + 1
        planned = self.planned_trials
        return (
            f"trial {ordinal} of {planned}"
            if planned and ordinal <= planned
            else f"trial {ordinal}"
        )

    def step_starting(
        self, kind: StepKind, micro_batch: int, accumulation_steps: int, checkpointing: bool
    ) -> None:
        """An `AnnouncedRunner`'s step is about to run."""
        mode = f"checkpointing {'on' if checkpointing else 'off'}"
        steps = f" x {accumulation_steps} steps" if accumulation_steps > 1 else ""
        if kind is StepKind.MEASURE:
            label = self.trial_label(self._measured)
            self._measured += 1
            self.starting(f"{label}: micro-batch {micro_batch}{steps}, {mode}: timing")
        else:
            what = "warm-up" if kind is StepKind.WARM_UP else "step"  # a probe's tracked step
            self.starting(f"{what}, {mode}: micro-batch {micro_batch}{steps}")

    def runner(self, runner: TrialRunner) -> TrialRunner:
        """`runner`, announcing each step here before it runs."""
        from autotune.engine.runner import AnnouncedRunner

        return AnnouncedRunner(runner, self.step_starting)

    def trial(self, trial: Trial) -> None:
        head = (
            f"{self.trial_label(trial.number)}: micro-batch {trial.micro_batch:>4} x "
            f"{trial.accumulation_steps:>3} steps, checkpointing {trial.checkpointing_label}"
            + (f", {trial.allocator_conf}" if trial.allocator_conf else "")
        )
        source = f" ({self.speed})" if self.speed else ""
        if trial.state is TrialState.COMPLETE and trial.samples_per_s is not None:
            spread = f" ±{trial.step_time_spread / 2:.0%}" if trial.step_time_spread else ""
            split = f", {communication_split(trial)}" if trial.compute_time_s is not None else ""
            self.line(
                f"{head}  [green]{trial.samples_per_s:,.1f} samples/s per GPU[/green]{spread}"
                f"{source}{split}"
            )
        else:
            self.line(f"{head}  [red]{trial.state.value}[/red]")


def follow_run(
    client: ServerClient,
    run_id: int,
    progress: Progress,
    *,
    timeout_s: float,
    still_working: Callable[[], None] | None = None,
) -> Run:
    """Show a run's status changes, attempts and trials as its worker stores them, until it
    finishes or `timeout_s` passes (then the run as it is). `still_working` is called each poll
    and may raise to stop following (the demo: its worker exited)."""
    seen: set[tuple[str, int, int]] = set()
    notice: str | None = None
    status: RunStatus | None = None
    deadline_s = time.monotonic() + timeout_s
    last_news_s = time.monotonic()
    while True:
        wait_s = max(0.0, min(POLL_S, deadline_s - time.monotonic()))
        run = client.get_run(run_id, wait_s=wait_s)
        news = False
        if run.status is not status:
            status = run.status
            on = f" on {run.worker_id}" if run.worker_id else ""
            progress.line(f"run {run.id}: {status.value}{on}")
            news = True
        if run.notice is not None and run.notice != notice:
            progress.line(f"run {run.id}: {run.notice}")
        notice = run.notice
        for record in run.attempts:
            key = ("attempt", record.claim_number, record.sequence)
            if key not in seen:
                seen.add(key)
                progress.attempt(record.checkpointing, record.attempt)
                news = True
        for trial_record in run.trials:
            key = ("trial", trial_record.claim_number, trial_record.trial.number)
            if key not in seen:
                seen.add(key)
                progress.trial(trial_record.trial)
                news = True
        if run.status.is_finished() or time.monotonic() >= deadline_s:
            return run
        if news:
            last_news_s = time.monotonic()
        elif time.monotonic() - last_news_s >= QUIET_LINE_S:
            last_news_s = time.monotonic()
            progress.line(
                f"run {run.id}: still {run.status.value} ({len(run.attempts)} attempts, "
                f"{len(run.trials)} trials so far)"
            )
        if still_working is not None:
            still_working()
