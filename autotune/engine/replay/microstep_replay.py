"""The estimate's micro-step replay: a step of many micro-steps written out from a traced step of
three, as the layer replay writes a deep model out from a shallow one
(docs/design.md#the-micro-step-replay).

A step of G micro-steps makes its G micro-batches, counts their items, then runs G micro-steps
(`autotune.engine.training.step.TrainingStep.run`): the first allocates the gradients, the
others add theirs into them, and on one rank nothing tells the last from the middle ones; on an
FSDP2 rank every micro-step reduce-scatters its gradients, and what only the last does (FSDP2's
end of the backward) comes after it. So every part of the step that runs once per micro-step (a
batch's making, its counting, a micro-step) is a unit repeated G times, and a step traced at
`TRACED_MICRO_STEPS` (a first, a second and a last copy of each unit) shows what every copy
past the first does. `write_out` writes each unit as its first copy, its second, and its last
G - 2 times (none for G = 2) in the journal (`autotune.engine.emulation.layer_journal`), which
the layer replay then writes out for the deep model and replays through the allocator model.

The rule, and what is checked before it is trusted:

* the journal's units are where the traced step's marks say (`StepMarks`: where each batch's
  making, each count and each micro-step starts); each kind's copies are back to back, the last
  as long as the second;
* the second and the last copy are one copy: the same allocations, ops and phases in the same
  order, and each reference to an allocation (a free, a gradient's completion) names the same
  position of the same kind of copy (its own or the first), or the same event outside the
  units, but where the second names the first and the last names its previous (the second):
  there the positions may differ, the first copy being laid out apart (an FSDP2 rank's first
  micro-step allocates its sharded gradients). So the last copy is what every copy past the
  second does after a copy like the second, and the second, as long, stands where the last
  does in a step of 2; no copy names a later copy;
* outside the units an event names the first or the last copy, or every copy of a kind in turn
  (the micro-batches freed together after the step: a fan), written out over every deep copy.

Anything else raises `NotReplayable`, and the estimate traces the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.engine.emulation.layer_journal import REFERENCES, NotReplayable

# The micro-steps a step is traced at to be written out for more: a first, a second and a last.
TRACED_MICRO_STEPS = 3

# How a copy's reference names a copy of a unit: its own, the one before it (the last's), the
# first (the second's previous is the first).
_SAME, _PREVIOUS, _FIRST = "same", "previous", "first"


@dataclass(frozen=True)
class StepMarks:
    """Where, in a traced step's journal, each copy of each unit starts: each micro-batch's
    making, each count of its items, each micro-step (`TRACED_MICRO_STEPS` of each)."""

    units: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Unit:
    """One kind of unit: its copies' [start, end) in the traced journal."""

    copies: tuple[tuple[int, int], ...]

    @property
    def start(self) -> int:
        return self.copies[0][0]

    @property
    def end(self) -> int:
        return self.copies[-1][1]

    @property
    def length(self) -> int:
        return self.copies[1][1] - self.copies[1][0]


def _units(marks: StepMarks, size: int) -> list[_Unit]:
    """The units, in order, each copy of the last as long as its middle one.

    Raises:
        NotReplayable: marks of another shape, or units that overlap.
    """
    units: list[_Unit] = []
    end = 0
    for starts in marks.units:
        if len(starts) != TRACED_MICRO_STEPS:
            raise NotReplayable(f"{len(starts)} copies of a unit, not {TRACED_MICRO_STEPS}")
        middle = starts[2] - starts[1]
        copies = ((starts[0], starts[1]), (starts[1], starts[2]), (starts[2], starts[2] + middle))
        if starts[0] < end or any(b <= a for a, b in copies) or copies[-1][1] > size:
            raise NotReplayable("the step's units overlap or are empty")
        units.append(_Unit(copies))
        end = copies[-1][1]
    return units


def write_out(
    journal: Sequence[tuple[Any, ...]], marks: StepMarks, accumulation_steps: int
) -> list[tuple[Any, ...]]:
    """The journal of the same step with `accumulation_steps` (2 or more) micro-steps instead
    of `TRACED_MICRO_STEPS` (module docstring): each unit's first copy, its second, its last
    `accumulation_steps` - 2 times (each a middle copy but the last); references renumbered.

    Raises:
        NotReplayable: the journal does not have the structure the rule needs.
    """
    if accumulation_steps < 2:
        raise ValueError(f"{accumulation_steps} micro-steps from {TRACED_MICRO_STEPS}")
    units = _units(marks, len(journal))
    # event -> (unit, copy, position)
    where: dict[int, tuple[int, int, int]] = {}
    for number, unit in enumerate(units):
        for copy, (start, end) in enumerate(unit.copies):
            for position, event in enumerate(range(start, end)):
                where[event] = (number, copy, position)

    def named(record: tuple[Any, ...], copy: int) -> tuple[Any, ...]:
        """A record of copy `copy` with its reference as (relation, unit, position), or the
        event outside the units it names. The second copy's previous is the first: its
        references to the first are named so (deep, too, its previous is the first)."""
        if record[0] not in REFERENCES:
            return record
        target = where.get(record[1])
        if target is None:
            return (record[0], "outside", record[1], *record[2:])
        unit, other, position = target
        if other > copy:
            raise NotReplayable("a copy names a later copy")
        if other == copy:
            relation = _SAME
        elif other == copy - 1 and copy == 2:
            relation = _PREVIOUS
        else:
            relation = _FIRST
        return (record[0], relation, unit, position, *record[2:])

    # Each unit's copies as templates: the first, the second, the last (which every middle
    # copy past the second repeats: the check below).
    templates: list[tuple[list[tuple[Any, ...]], ...]] = []
    for number, unit in enumerate(units):
        first, second, last = (
            [named(journal[event], copy) for event in range(start, end)]
            for copy, (start, end) in enumerate(unit.copies)
        )
        for mine, theirs in zip(second, last, strict=True):
            if mine == theirs:
                continue
            # The second copy names the first where the last names its previous (the
            # second); the first's events may stand elsewhere in it (a rank of several's first
            # micro-step allocates what the others do not: FSDP2's sharded gradients).
            if (
                mine[0] == theirs[0]
                and mine[0] in REFERENCES
                and mine[1] == _FIRST
                and theirs[1] == _PREVIOUS
                and mine[2] == theirs[2]
                and mine[4:] == theirs[4:]
            ):
                continue
            raise NotReplayable(f"the second and last copies differ in unit {number}")
        templates.append((first, second, last))

    copies = accumulation_steps
    out: list[tuple[Any, ...]] = []
    renumbered: dict[int, int] = {}  # a traced event outside the units -> its place
    placed: dict[tuple[int, int, int], int] = {}  # (unit, deep copy, position) -> its place

    def target_of(relation: str, unit: int, deep: int, position: int, event: int) -> int:
        copy = deep if relation == _SAME else deep - 1 if relation == _PREVIOUS else 0
        place = placed.get((unit, copy, position))
        if place is None:
            raise NotReplayable(f"event {event} names an event not yet written out")
        return place

    event = 0
    next_unit = 0
    while event < len(journal):
        if next_unit < len(units) and event == units[next_unit].start:
            unit = units[next_unit]
            for deep in range(copies):
                template = templates[next_unit][min(deep, 2)]
                for position, item in enumerate(template):
                    placed[(next_unit, deep, position)] = len(out)
                    if item[0] not in REFERENCES:
                        out.append(item)
                    elif item[1] == "outside":
                        out.append((item[0], _outside(renumbered, item[2], event), *item[3:]))
                    else:
                        place = target_of(item[1], item[2], deep, item[3], event)
                        out.append((item[0], place, *item[4:]))
            event = unit.end
            next_unit += 1
            continue
        fan = _fan(journal, event, where)
        if fan is not None:
            length, unit_number, descending, positions = fan
            order = range(copies - 1, -1, -1) if descending else range(copies)
            for deep in order:
                for offset, position in enumerate(positions):
                    record = journal[event + offset]
                    out.append((record[0], placed[(unit_number, deep, position)], *record[2:]))
            for offset in range(length):
                renumbered[event + offset] = len(out) - 1
            event += length
            continue
        record = journal[event]
        if record[0] in REFERENCES:
            target = where.get(record[1])
            if target is None:
                record = (record[0], _outside(renumbered, record[1], event), *record[2:])
            else:
                unit_number, copy, position = target
                if copy == 1:
                    raise NotReplayable(f"event {event} names a middle copy alone")
                deep = 0 if copy == 0 else copies - 1
                record = (record[0], placed[(unit_number, deep, position)], *record[2:])
        renumbered[event] = len(out)
        out.append(record)
        event += 1
    return out


def _outside(renumbered: dict[int, int], target: int, event: int) -> int:
    place = renumbered.get(target)
    if place is None:
        raise NotReplayable(f"event {event} names an event not yet written out")
    return place


def _fan(
    journal: Sequence[tuple[Any, ...]],
    event: int,
    where: dict[int, tuple[int, int, int]],
) -> tuple[int, int, bool, tuple[int, ...]] | None:
    """Outside the units, at `event`: references to every copy of one unit in turn, the same
    positions of each with the same records (the micro-batches freed after the step), as
    (events, unit, descending, positions), or None."""
    record = journal[event]
    if record[0] not in REFERENCES or record[1] not in where:
        return None
    unit, copy, _ = where[record[1]]
    if copy not in (0, TRACED_MICRO_STEPS - 1):
        return None
    descending = copy != 0
    order = (2, 1, 0) if descending else (0, 1, 2)
    # The records naming the first copy in the order, then the others' must repeat them.
    positions: list[int] = []
    shape: list[tuple[Any, ...]] = []
    at = event
    while at < len(journal):
        candidate = journal[at]
        if candidate[0] not in REFERENCES:
            break
        target = where.get(candidate[1])
        if target is None or target[0] != unit or target[1] != order[0]:
            break
        positions.append(target[2])
        shape.append((candidate[0], *candidate[2:]))
        at += 1
    for copy in order[1:]:
        for offset, position in enumerate(positions):
            if at >= len(journal):
                return None
            candidate = journal[at]
            if (
                candidate[0] not in REFERENCES
                or where.get(candidate[1]) != (unit, copy, position)
                or (candidate[0], *candidate[2:]) != shape[offset]
            ):
                return None
            at += 1
    return at - event, unit, descending, tuple(positions)
