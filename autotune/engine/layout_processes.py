"""Layouts tuned side by side: each of a `sharding: auto` tune's layouts in a child process, as
many at a time as asked (docs/design.md#choosing-the-layout).

An estimate's layout tune is some minutes of one core's Python (each layout a tune of its own, on a
traced model of its own), and the layouts share nothing but the trace mode's cache: on a machine of
several cores they can run at once. The children are forked from the caller, so a layout's runner
is opened in its child by the caller's own `open_layout` (what is pickled on the way in is the
layout's job: its spec and study name) and the child starts with what the caller imported and the
trace mode's cache as the caller left it. The layouts are handed out the longest first (FSDP2's
sharded layouts, then DDP's: `_longest_first`), and each child sends its progress (attempts,
trials, phases) to the caller, which calls the caller's callbacks in its own process, a phase
named by its layout; a child's result comes back as a `TuneResult`. An error in a child is
raised in the caller as the child raised it (its traceback attached), and a child that dies
stops the tune with that said: no wait is silent.

Only an estimate's runners may run side by side (`EstimateRunner`: nothing executed, nothing
timed): a device's trials run on the device, one at a time, and a timed one would time its
neighbours too.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core.memory.optimizer_states import FSDP2_SHARDINGS
from autotune.core.parallel.layout_choice import LAYOUT_NAMES
from autotune.core.schemas import Sharding, Spec, StepOutcome, Trial, TuneResult
from autotune.engine.probe import AttemptCallback, FitTracer, PhaseCallback
from autotune.engine.runner import TrialRunner
from autotune.engine.tuner import TrialCallback, tune_session

LayoutRunner = Callable[[Spec], tuple[TrialRunner, FitTracer | None]]
LayoutCallback = Callable[[Sharding, int, int], None]

# How often the caller looks at its children while none has news: a child that died is named
# within this many seconds.
_POLL_S = 0.2


@dataclass(frozen=True)
class LayoutJob:
    """One layout's tune: its place among the candidates, its spec and its study's name."""

    index: int
    spec: Spec
    study_name: str


@dataclass(frozen=True)
class TuneOptions:
    """What every layout's `tune_session` takes besides its runner and callbacks."""

    storage_url: str
    n_trials: int | None
    seed: int
    target_seconds: float


def tune_job(
    job: LayoutJob,
    open_layout: LayoutRunner,
    options: TuneOptions,
    *,
    on_attempt: AttemptCallback | None,
    on_trial: TrialCallback | None,
    on_phase: PhaseCallback | None,
) -> TuneResult:
    """One layout's tune, on the runner `open_layout` opens for it (here, or in a child)."""
    runner, tracer = open_layout(job.spec)
    return tune_session(
        runner,
        storage_url=options.storage_url,
        study_name=job.study_name,
        n_trials=options.n_trials,
        seed=options.seed,
        target_seconds=options.target_seconds,
        on_attempt=on_attempt,
        on_trial=on_trial,
        tracer=tracer,
        on_phase=on_phase,
    )


# A child's state, set as the pool forks it (`_start_child`): the caller's opener, the options
# and where its progress goes.
_child: dict[str, Any] = {}


def _start_child(open_layout: LayoutRunner, options: TuneOptions, events: Any) -> None:
    # An estimate computes nothing, and a forked child that entered the OpenMP thread pool its
    # parent may have started could hang in it (torch's DataLoader workers set the same).
    torch.set_num_threads(1)
    _child.update(open_layout=open_layout, options=options, events=events)


def _tune_in_child(job: LayoutJob, count: int) -> TuneResult:
    """One layout's tune in a child, its progress sent to the caller."""
    events = _child["events"]
    sharding = job.spec.training.sharding
    events.put(("layout", job.index, sharding, count))

    def on_attempt(checkpointing: bool, outcome: StepOutcome) -> None:
        events.put(("attempt", job.index, checkpointing, outcome))

    def on_trial(trial: Trial) -> None:
        events.put(("trial", job.index, trial))

    def on_phase(text: str, planned: int | None) -> None:
        events.put(("phase", job.index, text, planned))

    return tune_job(
        job,
        _child["open_layout"],
        _child["options"],
        on_attempt=on_attempt,
        on_trial=on_trial,
        on_phase=on_phase,
    )


def tune_side_by_side(
    jobs: Sequence[LayoutJob],
    open_layout: LayoutRunner,
    options: TuneOptions,
    *,
    processes: int,
    on_attempt: AttemptCallback | None = None,
    on_trial: TrialCallback | None = None,
    on_phase: PhaseCallback | None = None,
    on_layout: LayoutCallback | None = None,
) -> list[TuneResult]:
    """Each job's `tune_session` in one of `processes` forked children, the results in the
    jobs' order. The callbacks run here, as the children report: `on_layout` as a layout
    starts, `on_phase` with the layout's name before the phase (and alone before an attempt
    or a trial of another layout than the last reported).

    Raises:
        ValueError: fewer than 1 process.
        RuntimeError: a child died (killed, out of host memory) before its layouts were done.
        Exception: what a child's tune raised, as it raised it.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    context = multiprocessing.get_context("fork")
    events = context.SimpleQueue()
    names = {job.index: LAYOUT_NAMES[job.spec.training.sharding] for job in jobs}

    # The layout whose progress was reported last: an attempt or a trial of another one is
    # preceded by a phase naming it, so that interleaved lines say whose they are.
    last: int | None = None

    def report(event: tuple[Any, ...]) -> None:
        nonlocal last
        kind, index, *rest = event
        if kind in ("attempt", "trial") and last != index and on_phase is not None:
            on_phase(f"{names[index]}:", None)
        if kind != "layout":
            last = index
        if kind == "layout" and on_layout is not None:
            sharding, count = rest
            on_layout(sharding, index, count)
        elif kind == "phase" and on_phase is not None:
            text, planned = rest
            on_phase(f"{names[index]}: {text}", planned)
        elif kind == "attempt" and on_attempt is not None:
            checkpointing, outcome = rest
            on_attempt(checkpointing, outcome)
        elif kind == "trial" and on_trial is not None:
            on_trial(rest[0])

    def drain() -> None:
        while not events.empty():
            report(events.get())

    # The pool has no public handle on its children, and drops its own when one dies: they
    # are this process's children that were not before it.
    earlier = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        max_workers=min(processes, len(jobs)),
        mp_context=context,
        initializer=_start_child,
        initargs=(open_layout, options, events),
    )
    results: dict[int, TuneResult] = {}
    try:
        futures: dict[Future[TuneResult], int] = {
            pool.submit(_tune_in_child, job, len(jobs)): job.index for job in _longest_first(jobs)
        }
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            drain()
            for future in done:
                results[futures[future]] = _result_of(future)
        drain()
    except BaseException:
        _stop(pool, [c for c in multiprocessing.active_children() if c not in earlier])
        raise
    pool.shutdown()
    return [results[job.index] for job in jobs]


def _longest_first(jobs: Sequence[LayoutJob]) -> list[LayoutJob]:
    """The jobs in the order they are handed out: FSDP2's layouts (ZeRO-2, ZeRO-3, hybrid)
    first, then DDP's, each kind in the candidates' order. An FSDP2 layout's tune takes the
    longer (it builds and warms two sharded models, FSDP2's parameters and DTensor's optimizer
    dispatch among its costs: the Llama-3-8B LoRA 1 x 8 cell's ZeRO-3 tune 41 CPU s against
    DDP's 31), so the process that ends last ends on a short one: of a 4 x 8 cell's five
    layouts on two processes, the last no longer runs alone for most of its tune
    (docs/design.md#choosing-the-layout)."""
    return sorted(jobs, key=lambda job: job.spec.training.sharding not in FSDP2_SHARDINGS)


def _result_of(future: Future[TuneResult]) -> TuneResult:
    try:
        return future.result()
    except BrokenProcessPool as error:
        raise RuntimeError(
            "a layout's process died before its tune ended (killed, or out of host memory); "
            "tune the layouts one at a time (processes 1) to see where"
        ) from error


def _stop(pool: ProcessPoolExecutor, children: Sequence[Any]) -> None:
    """Stop the children now (a tune that will not be used is not waited for), and wait for
    the pool's thread, which finds them gone, and for them."""
    for child in children:
        child.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
    for child in children:
        child.join(timeout=5)


__all__ = [
    "LayoutCallback",
    "LayoutJob",
    "LayoutRunner",
    "TuneOptions",
    "tune_job",
    "tune_side_by_side",
]
