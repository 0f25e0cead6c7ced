"""The estimate's micro-step replay (autotune/engine/replay/microstep_replay.py): a step of 4
or more
micro-steps written out from a traced step of 3 is the journal of the step traced whole, record
for record, and the trials replayed from it are the whole model's traced trials to the byte;
what the rule cannot vouch for raises NotReplayable, and several ranks trace their steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from autotune.core.schemas import Spec
from autotune.engine.emulation.layer_journal import ALLOC, FREE, GRAD, OP, NotReplayable
from autotune.engine.estimate import EstimateRunner
from autotune.engine.replay.microstep_replay import TRACED_MICRO_STEPS, StepMarks, write_out
from autotune.engine.training.step import TrainingStep
from tests.autotune_tests.engine.replay.test_layer_replay import _config, _the_same
from tests.autotune_tests.engine.replay.test_layer_replay import _spec as layer_replay_spec

pytest.importorskip("transformers")

MiB = 2**20


def _spec(depth: int, *, lora: bool, **training: Any) -> Spec:
    return layer_replay_spec(_config("llama", depth), lora=lora, **training)


@pytest.fixture
def traced_micro_steps() -> Iterator[list[int]]:
    """The micro-steps of every step run meanwhile (each traced step runs TrainingStep.run)."""
    counts: list[int] = []
    run = TrainingStep.run

    def counted(step: TrainingStep, micro_batch: int, accumulation_steps: int = 1) -> float:
        counts.append(accumulation_steps)
        return run(step, micro_batch, accumulation_steps)

    TrainingStep.run = counted  # type: ignore[method-assign, assignment]
    try:
        yield counts
    finally:
        TrainingStep.run = run  # type: ignore[method-assign]


@pytest.mark.e2e
@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_step_written_out_is_the_journal_of_the_step_traced_whole(
    lora: bool, checkpointing: bool
) -> None:
    runner = EstimateRunner(_spec(9, lora=lora), capacity_bytes=40 * MiB)
    replay = runner._replay
    assert replay is not None
    assert runner.warm_up(checkpointing=True).fits
    for micro_batch in (1, 2):
        # 2 too: partial checkpointing's search writes its trials out from the step of 3.
        traced = replay._journal(micro_batch, TRACED_MICRO_STEPS, checkpointing, None)
        assert traced.marks is not None
        # No middle micro-step, one, and four (3 is the traced step itself).
        for accumulation in (2, 4, 7):
            whole = replay._journal(micro_batch, accumulation, checkpointing, None).journal
            assert write_out(traced.journal, traced.marks, accumulation) == whole


# (micro-batch, accumulation, checkpointing): sizes that fit and sizes that run out of the
# capacities below, at 4, 5 and 64 micro-steps (a trial traces at most 5).
TRIALS = [(1, 4, False), (2, 5, True), (4, 64, False), (1, 64, True), (8, 5, True), (16, 4, False)]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("lora", "capacity_bytes"), [(True, 20 * MiB), (False, 48 * MiB), (True, 12 * MiB)]
)
def test_every_replayed_trial_of_many_micro_steps_is_the_whole_trace_to_the_byte(
    lora: bool, capacity_bytes: int, traced_micro_steps: list[int]
) -> None:
    spec = _spec(8, lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    _the_same(replayed.warm_up(), traced.warm_up())
    fits = set()
    for micro_batch, accumulation, checkpointing in TRIALS:
        traced_micro_steps.clear()
        outcome = replayed.trial(micro_batch, accumulation, checkpointing=checkpointing)
        # The replay traced a step of 3 (or answered from one traced before), not of 4 or 5.
        assert max(traced_micro_steps, default=TRACED_MICRO_STEPS) == TRACED_MICRO_STEPS
        _the_same(outcome, traced.trial(micro_batch, accumulation, checkpointing=checkpointing))
        fits.add(outcome.fits)
    assert fits == {True, False}  # both kinds of trial were compared
    assert replayed.layer_replay  # and the replay went on after every one of them


@pytest.mark.e2e
@pytest.mark.parametrize("lora", [True, False])
def test_every_partial_checkpointing_trial_of_many_micro_steps_is_the_whole_trace(
    lora: bool, traced_micro_steps: list[int]
) -> None:
    spec = _spec(12, lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=16 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=16 * MiB, layer_replay=False)
    _the_same(replayed.warm_up(checkpointing=True), traced.warm_up(checkpointing=True))
    fits = set()
    # (5 and 6 of 12, which share a shallow step, are test_layer_replay's.)
    for blocks in (2, 6, 11):
        for micro_batch, accumulation in ((1, 5), (2, 64), (4, 4)):
            traced_micro_steps.clear()
            outcome = replayed.trial(
                micro_batch, accumulation, checkpointing=True, checkpointed_blocks=blocks
            )
            assert max(traced_micro_steps, default=TRACED_MICRO_STEPS) == TRACED_MICRO_STEPS
            whole = traced.trial(
                micro_batch, accumulation, checkpointing=True, checkpointed_blocks=blocks
            )
            _the_same(outcome, whole)
            fits.add(outcome.fits)
    assert fits == {True, False}
    assert replayed.layer_replay and replayed.partial_replay


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("sharding", "ranks"),
    [
        ("zero2", {"world_size": 2}),
        ("zero3", {"world_size": 2}),
        ("hybrid", {"nodes": 2, "gpus_per_node": 2}),
    ],
)
def test_an_fsdp2_rank_s_step_written_out_is_the_journal_of_the_step_traced_whole(
    sharding: str, ranks: dict[str, int]
) -> None:
    # Each micro-step reduce-scatters its gradients, so the last runs as a middle one; its
    # first allocates the sharded gradients, so the second names the first's events at other
    # positions than a middle one names its previous's.
    runner = EstimateRunner(
        _spec(9, lora=True, sharding=sharding, **ranks), capacity_bytes=800 * MiB
    )
    replay = runner._replay
    assert replay is not None and replay.writes_out_micro_steps
    assert runner.warm_up(checkpointing=True).fits
    for checkpointing in (False, True):
        traced = replay._journal(1, TRACED_MICRO_STEPS, checkpointing, None)
        assert traced.marks is not None
        for accumulation in (2, 4, 7):
            whole = replay._journal(1, accumulation, checkpointing, None).journal
            assert write_out(traced.journal, traced.marks, accumulation) == whole


@pytest.mark.e2e
@pytest.mark.parametrize(("sharding", "replay_traces"), [("none", 5), ("zero3", 3)])
def test_ddp_ranks_trace_every_micro_step_and_fsdp2_ranks_write_theirs_out(
    sharding: str, replay_traces: int, traced_micro_steps: list[int]
) -> None:
    # DDP's last micro-step synchronises, inside it: its steps are traced at their length (at
    # most 5). FSDP2's are written out from 3, and answer as the whole model's trace of 5.
    spec = _spec(8, lora=True, world_size=2, sharding=sharding)
    replayed = EstimateRunner(spec, capacity_bytes=64 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=64 * MiB, layer_replay=False)
    assert replayed.layer_replay
    _the_same(replayed.warm_up(), traced.warm_up())
    for micro_batch, accumulation in ((1, 64), (2, 4)):
        traced_micro_steps.clear()
        _the_same(
            replayed.trial(micro_batch, accumulation), traced.trial(micro_batch, accumulation)
        )
        assert traced_micro_steps == [min(replay_traces, accumulation), min(5, accumulation)]
    assert replayed.layer_replay


# A made-up step: (ALLOC, nbytes, context, tag, phase, category), (FREE, allocation, context),
# (OP, context, tag, phase, peak_check, op), (GRAD, allocation, context, parameter).
def _made_up(copies: int, *, last_frees_previous: bool = False) -> list[tuple[Any, ...]]:
    """A resident, per copy a batch (an allocation), then per copy a micro-step: the first
    allocates a gradient, each allocates an activation and frees it, the middle ones and the
    last add into the gradient; then the batches freed last to first, the gradient freed."""
    journal: list[tuple[Any, ...]] = [(ALLOC, 512, -1, -1, "f", 1)]
    batches = []
    for _ in range(copies):
        batches.append(len(journal))
        journal += [(ALLOC, 64, -1, -1, "f", 0), (OP, -1, -1, "f", True, "randint")]
    gradient = -1
    for copy in range(copies):
        activation = len(journal)
        journal += [(ALLOC, 128, 0, 0, "f", 0), (OP, 0, 0, "f", True, "mm")]
        if copy == 0:
            gradient = len(journal)
            journal += [(ALLOC, 32, 0, 0, "b", 0), (GRAD, len(journal), 0, 0)]
        elif last_frees_previous and copy == copies - 1:
            # The last frees the previous copy's activation where the middle one names its
            # gradient.
            journal += [(OP, 0, 0, "b", False, "add_"), (FREE, activation - 5, 0)]
        else:
            journal += [(OP, 0, 0, "b", False, "add_"), (GRAD, gradient, 0, 0)]
        journal.append((FREE, activation, 0))
    journal += [(FREE, batch, -1) for batch in reversed(batches)]
    journal.append((FREE, gradient, -1))
    return journal


def _keeping_previous(copies: int) -> tuple[list[tuple[Any, ...]], StepMarks]:
    """A made-up step whose micro-steps each free the previous one's activation (the first's
    after its gradient, which the others do not allocate: its activation stands elsewhere in
    it), the last's freed after the step; with its marks."""
    journal: list[tuple[Any, ...]] = [(ALLOC, 512, -1, -1, "f", 1)]
    batches = []
    for _ in range(copies):
        batches.append(len(journal))
        journal += [(ALLOC, 64, -1, -1, "f", 0), (OP, -1, -1, "f", True, "randint")]
    starts = []
    gradient = previous = -1
    for copy in range(copies):
        starts.append(len(journal))
        if copy == 0:
            gradient = len(journal)
            journal += [(ALLOC, 32, 0, 0, "b", 0), (GRAD, len(journal), 0, 0)]
        activation = len(journal)
        journal += [(ALLOC, 128, 0, 0, "f", 0), (OP, 0, 0, "f", True, "mm")]
        if copy > 0:
            journal += [(OP, 0, 0, "b", False, "add_"), (GRAD, gradient, 0, 0)]
            journal.append((FREE, previous, 0))
        previous = activation
    journal.append((FREE, previous, -1))
    journal += [(FREE, batch, -1) for batch in reversed(batches)]
    journal.append((FREE, gradient, -1))
    return journal, StepMarks((tuple(range(1, 1 + 2 * copies, 2)), tuple(starts)))


def _marks_of(journal: list[tuple[Any, ...]], copies: int) -> StepMarks:
    micro_steps = [i for i, r in enumerate(journal) if r[0] == ALLOC and r[1] == 128]
    return StepMarks((tuple(range(1, 1 + 2 * copies, 2)), tuple(micro_steps[:copies])))


def test_a_made_up_step_is_written_out_for_any_count_of_micro_steps() -> None:
    traced = _made_up(TRACED_MICRO_STEPS)
    for copies in (3, 4, 9):
        assert write_out(traced, _marks_of(traced, 3), copies) == _made_up(copies)


def test_a_step_whose_first_micro_step_is_laid_out_apart_is_written_out() -> None:
    # The second micro-step frees the first's activation at another position than a middle
    # one frees its previous's; the step of 2 is the first and the second.
    traced, marks = _keeping_previous(TRACED_MICRO_STEPS)
    for copies in (2, 3, 4, 9):
        assert write_out(traced, marks, copies) == _keeping_previous(copies)[0]


def test_what_the_rule_cannot_vouch_for_is_not_replayable() -> None:
    # The last micro-step frees something the middle one does not.
    traced = _made_up(TRACED_MICRO_STEPS, last_frees_previous=True)
    with pytest.raises(NotReplayable, match="differ"):
        write_out(traced, _marks_of(traced, 3), 5)
    # Two micro-steps marked, not three.
    traced = _made_up(TRACED_MICRO_STEPS)
    marks = _marks_of(traced, 3)
    with pytest.raises(NotReplayable, match="copies"):
        write_out(traced, StepMarks((marks.units[0], marks.units[1][:2])), 5)
    # After the step, the middle micro-step's activation named alone.
    middle = marks.units[1][1]
    with pytest.raises(NotReplayable, match="middle copy alone"):
        write_out([*traced, (FREE, middle, -1)], marks, 5)
    with pytest.raises(ValueError, match="micro-steps"):  # 2 is written out: first and last
        write_out(traced, marks, 1)
