"""The layer replay's ZeRO-1 rank: a deep decoder's `ZeroRedundancyOptimizer` partition and
optimizer events from a shallow one's.

torch's `ZeroRedundancyOptimizer` (`autotune.engine.training.sharding.zero1_optimizer`) sorts all
trainable parameters by size (largest first, ties in model order) and gives each in turn to the
rank with the fewest elements so far; the emulated rank is the one whose partition has the most
bytes. Its local optimizer runs its foreach ops over that partition in that order, and after the
step every parameter of every rank is broadcast. So which of a layer's parameters the rank
updates, and the order its optimizer's events sweep the layers in, follow the depth: no
repetition of a shallow model's layers. The partition is a pure function of the parameters'
sizes, though, and a decoder's parameters are those outside the layers around one layer's
repeated per layer. `Zero1Partition` computes the deep model's partition as torch does, and
`cut` / `splice` take the rank's optimizer events out of the shallow journal before
`autotune.engine.replay.layer_replay.expand` writes the rest out, then put the deep rank's in: the
resident optimizer state (per local parameter, in its order) and the optimizer step (its state
made in the first step, its foreach ops' per-parameter outputs, their release, the
broadcasts), each a run of one unit of events per parameter whose bytes are the parameter's,
written out for the deep partition (docs/design.md#the-layer-replay). Its speed pass likewise:
the local optimizer's foreach kernels move the deep rank's partition (`PartitionBytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from autotune.core.memory.gradient_buckets import BucketTensor
from autotune.core.schemas import Phase
from autotune.engine.emulation.layer_journal import (
    ALLOC,
    FIXED,
    FREE,
    MARK,
    NO_LAYER,
    OP,
    OPTIMIZER_STATE,
    REFERENCES,
    NotReplayable,
)
from autotune.engine.replay.layer_buckets import LayerBuckets


@dataclass(frozen=True)
class ParameterSize:
    """A trainable parameter as the partition reads it: elements, bytes, and its decoder layer
    (None: outside the layers)."""

    numel: int
    nbytes: int
    layer: int | None


@dataclass(frozen=True)
class RankShare:
    """The emulated rank's share: its parameters (numbers in the optimizer's order) in its local
    optimizer's order with their bytes and elements, and every rank's parameters (the
    broadcasts after the step)."""

    local: tuple[int, ...]
    local_nbytes: tuple[int, ...]
    local_numel: tuple[int, ...]
    parameter_count: int


def rank_share(parameters: Sequence[ParameterSize], world_size: int) -> RankShare:
    """The partition of torch's `ZeroRedundancyOptimizer._partition_parameters` (sorted by
    elements, largest first and stable; each to the first rank with the fewest elements so
    far), and the rank `zero1_optimizer` emulates: the first whose partition has the most
    bytes."""
    sizes = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for number in sorted(range(len(parameters)), key=lambda n: parameters[n].numel, reverse=True):
        rank = sizes.index(min(sizes))
        ranks[rank].append(number)
        sizes[rank] += parameters[number].numel
    partition_bytes = [sum(parameters[n].nbytes for n in numbers) for numbers in ranks]
    heaviest = partition_bytes.index(max(partition_bytes))
    local = tuple(ranks[heaviest])
    return RankShare(
        local,
        tuple(parameters[n].nbytes for n in local),
        tuple(parameters[n].numel for n in local),
        len(parameters),
    )


def deep_parameters(
    parameters: Sequence[ParameterSize], traced_layers: int, depth: int
) -> list[ParameterSize]:
    """The deep model's parameters in the optimizer's order: those before the layers, the
    layers' (one layer's repeated per layer), those after.

    Raises:
        NotReplayable: the parameters are not one block per layer in layer order.
    """
    # Laid out as DDP's buckets lay their parameters out (`LayerBuckets`, which checks that
    # shape), the kind of each its elements.
    layout = LayerBuckets(
        [BucketTensor(p.nbytes, p.numel) for p in parameters],
        [p.layer for p in parameters],
        traced_layers,
        depth,
    )
    per_layer = sum(1 for p in parameters if p.layer == 0)
    deep: list[ParameterSize | None] = [None] * (
        len(parameters) + per_layer * (depth - traced_layers)
    )
    for number, parameter in enumerate(parameters):
        if parameter.layer is None:
            deep[layout.deep_parameter(number, None)] = parameter
        elif parameter.layer == 0:
            for layer in range(depth):
                deep[layout.deep_parameter(number, layer)] = ParameterSize(
                    parameter.numel, parameter.nbytes, layer
                )
    return [parameter for parameter in deep if parameter is not None]


# A parsed region: a record as it is, a run of one unit per local parameter (the first unit
# may differ from the others, each ALLOC's bytes either fixed or the parameter's: None), the
# release of a unit run's allocations, or a run of one unit per parameter of every rank.
@dataclass(frozen=True)
class _Fixed:
    record: tuple[Any, ...]
    target: int | None  # a reference: the element (a fixed one) it names


@dataclass(frozen=True)
class _PerLocal:
    first: tuple[tuple[Any, ...], ...]
    unit: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class _Release:
    run: int  # the element (a _PerLocal of one allocation per unit) whose outputs it frees
    reverse: bool
    context: int


@dataclass(frozen=True)
class _PerParameter:
    first: tuple[tuple[Any, ...], ...]
    unit: tuple[tuple[Any, ...], ...]


_Element = _Fixed | _PerLocal | _Release | _PerParameter


def _untagged(record: tuple[Any, ...]) -> tuple[Any, ...]:
    """`record` without its tag (the layer its tensors are of, which the replay of a journal
    does not read and which differs from parameter to parameter)."""
    if record[0] == ALLOC:
        return (*record[:3], FIXED, *record[4:])
    if record[0] == OP:
        return (record[0], record[1], FIXED, *record[3:])
    return record


_UNIT_MAX = 6
_SIZED = None  # an ALLOC's bytes that are the unit's parameter's


def _sized_units(
    records: Sequence[tuple[Any, ...]], start: int, nbytes: Sequence[int], width: int
) -> tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]] | None:
    """`len(nbytes)` units of `width` records from `start`, one per parameter: the same kinds;
    each ALLOC's bytes the parameter's (in at least one place) or fixed; no references; the
    units after the first identical. Returns the first unit and the others' template, the
    parameter's bytes replaced by `_SIZED`; None when they are not such units."""
    count = len(nbytes)
    if count < 2 or start + count * width > len(records):
        return None
    units = [
        [_untagged(r) for r in records[start + k * width : start + (k + 1) * width]]
        for k in range(count)
    ]
    sized: list[bool] = []
    for position in range(width):
        column = [unit[position] for unit in units]
        kinds = {record[0] for record in column}
        if len(kinds) != 1 or kinds & set(REFERENCES):
            return None
        if column[0][0] == ALLOC:
            sizes = [record[1] for record in column]
            sized.append(sizes == list(nbytes))
            if not sized[-1] and len(set(sizes)) != 1:
                return None
        else:
            sized.append(False)
    if not any(sized):
        return None

    def template(unit: Sequence[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
        return tuple(
            (ALLOC, _SIZED, *record[2:]) if is_sized else record
            for record, is_sized in zip(unit, sized, strict=True)
        )

    later = template(units[1])
    if any(template(unit) != later for unit in units[2:]):
        return None
    return template(units[0]), later


def _parameter_units(
    records: Sequence[tuple[Any, ...]], start: int, count: int
) -> tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...], int] | None:
    """`count` units of ops only (the broadcasts of every rank's parameters, each with the view
    it sends), the units after the first identical: the first, the template and the width."""
    for width in range(1, 3):
        if count < 2 or start + count * width > len(records):
            return None
        units = [
            [_untagged(r) for r in records[start + k * width : start + (k + 1) * width]]
            for k in range(count)
        ]
        if any(record[0] != OP for unit in units for record in unit):
            continue
        if all(unit == units[1] for unit in units[2:]) and all(
            (a[0], a[1], a[3], a[5]) == (b[0], b[1], b[3], b[5])  # but the peak's check
            for a, b in zip(units[0], units[1], strict=True)
        ):
            return tuple(units[0]), tuple(units[1]), width
    return None


def _parse(records: Sequence[tuple[Any, ...]], start: int, share: RankShare) -> list[_Element]:
    """The elements of a region (`records`, whose first is the journal's event `start`).

    Raises:
        NotReplayable: a reference out of the region, or a release of no unit run."""
    elements: list[_Element] = []
    origin: dict[int, int] = {}  # a region's event -> its element
    # Unit runs of one allocation each: their events in order, by element.
    allocations: dict[int, list[int]] = {}
    local = share.local_nbytes
    index = 0
    while index < len(records):
        record = records[index]
        every = _parameter_units(records, index, share.parameter_count)
        if every is not None and any("c10d" in str(r[5]) for r in every[0]):
            first, unit, width = every
            elements.append(_PerParameter(first, unit))
            index += share.parameter_count * width
            continue
        for width in range(1, _UNIT_MAX + 1):
            units = _sized_units(records, index, local, width)
            if units is not None:
                number = len(elements)
                elements.append(_PerLocal(*units))
                span = range(index, index + len(local) * width)
                for event in span:
                    origin[event] = number
                if width == 1:
                    allocations[number] = [start + event for event in span]
                index += len(local) * width
                break
        else:
            if record[0] == FREE:
                release = _release(records, index, start, len(local), allocations)
                if release is not None:
                    elements.append(release)
                    index += len(local)
                    continue
            target = None
            if record[0] in REFERENCES:
                # Only an event of its own kind: one made once whatever the partition.
                target = origin.get(record[1] - start)
                if target is None or not isinstance(elements[target], _Fixed):
                    raise NotReplayable(f"the optimizer's event {start + index} names another")
            origin[index] = len(elements)
            elements.append(_Fixed(_untagged(record), target))
            index += 1
    return elements


def _release(
    records: Sequence[tuple[Any, ...]],
    index: int,
    start: int,
    count: int,
    allocations: dict[int, list[int]],
) -> _Release | None:
    """The frees from `index` of every allocation of a unit run, in its order or reversed."""
    frees = records[index : index + count]
    if len(frees) != count or any(r[0] != FREE or r[2] != frees[0][2] for r in frees):
        return None
    named = [r[1] for r in frees]
    for run, events in allocations.items():
        if named == events or named == events[::-1]:
            return _Release(run, named != events, frees[0][2])
    return None


def _write(elements: Sequence[_Element], share: RankShare, offset: int) -> list[tuple[Any, ...]]:
    """The deep region for `share`, its first event at `offset` of the deep journal."""
    out: list[tuple[Any, ...]] = []
    placed: dict[int, int] = {}  # a fixed element -> its deep event
    allocations: dict[int, list[int]] = {}
    for number, element in enumerate(elements):
        if isinstance(element, _Fixed):
            record = element.record
            if element.target is not None:
                record = (record[0], placed[element.target], *record[2:])
            placed[number] = offset + len(out)
            out.append(record)
        elif isinstance(element, _PerLocal):
            events: list[int] = []
            for k, nbytes in enumerate(share.local_nbytes):
                for record in element.first if k == 0 else element.unit:
                    if record[0] == ALLOC:
                        events.append(offset + len(out))
                        if record[1] is _SIZED:
                            record = (ALLOC, nbytes, *record[2:])
                    out.append(record)
            allocations[number] = events
        elif isinstance(element, _Release):
            named = allocations[element.run]
            for event in reversed(named) if element.reverse else named:
                out.append((FREE, event, element.context))
        else:
            for k in range(share.parameter_count):
                out.extend(element.first if k == 0 else element.unit)
    return out


@dataclass(frozen=True)
class PartitionBytes:
    """The bytes a foreach kernel (or fused optimizer) of the rank's local optimizer moves on
    the deep rank, from the shallow rank's launch (`shallow`'s partition; `deep`'s of `depth`
    layers): one launch over a list of one tensor per local parameter, each of its parameter's
    elements, moves that list's dtype's bytes of every element of the deep rank's parameters."""

    shallow: RankShare
    deep: RankShare
    depth: int

    def deep_bytes(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Sequence[object]
    ) -> int | None:
        """The deep launch's bytes read and written, `args` and `kwargs` the shallow launch's
        and `outputs` what it writes (what it returns, the arguments it writes in place): each
        list over the partition scaled to the deep one, any other tensor as it is. None when
        no argument or output is such a list."""
        numel = list(self.shallow.local_numel)
        deep_numel = sum(self.deep.local_numel)
        nbytes = 0
        partition_lists = 0
        for item in (*args, *kwargs.values(), *outputs):
            if (
                isinstance(item, (list, tuple))
                and len(item) == len(numel)
                and all(isinstance(t, torch.Tensor) for t in item)
                and [t.numel() for t in item] == numel
                and len({t.element_size() for t in item}) == 1
            ):
                nbytes += item[0].element_size() * deep_numel
                partition_lists += 1
                continue
            for leaf in pytree.tree_leaves(item):
                if isinstance(leaf, torch.Tensor):
                    nbytes += leaf.numel() * leaf.element_size()
        return nbytes if partition_lists else None


@dataclass(frozen=True)
class Zero1Cut:
    """A shallow journal without its rank's optimizer events, and those events parsed: the
    resident optimizer state's (None: none resident) and the step's."""

    journal: list[tuple[Any, ...]]
    residents: list[_Element] | None
    step: list[_Element]


# Placeholders of the two regions in the cut journal, found again in the deep one by identity.
_RESIDENTS = (MARK, NO_LAYER, "ZeRO-1 residents")
_STEP = (MARK, NO_LAYER, "ZeRO-1 step")


def cut(journal: Sequence[tuple[Any, ...]], share: RankShare) -> Zero1Cut:
    """The journal without its optimizer events (each region replaced by a placeholder, the
    references after it renumbered), and the regions parsed against the shallow rank's share.

    The residents' region: the resident optimizer state, a run of allocations before the
    first op. The step's: from the first event of the optimizer phase to the last broadcast.

    Raises:
        NotReplayable: the regions are not runs of one unit per parameter, or an event
            outside them names one inside.
    """
    first_op = next((i for i, r in enumerate(journal) if r[0] == OP), len(journal))
    states = [
        i for i in range(first_op) if journal[i][0] == ALLOC and journal[i][5] == OPTIMIZER_STATE
    ]
    regions: list[tuple[int, int, tuple[Any, ...]]] = []
    if states:
        regions.append((states[0], states[-1] + 1, _RESIDENTS))
    step_start = next(
        (
            i
            for i, r in enumerate(journal)
            if (r[0] == ALLOC and r[4] is Phase.OPTIMIZER)
            or (r[0] == OP and r[3] is Phase.OPTIMIZER)
        ),
        None,
    )
    broadcasts = [
        i for i, r in enumerate(journal) if r[0] == OP and str(r[5]).startswith("c10d.broadcast")
    ]
    if step_start is None or not broadcasts or broadcasts[-1] < step_start:
        raise NotReplayable("no optimizer step and broadcasts in the journal")
    regions.append((step_start, broadcasts[-1] + 1, _STEP))
    parsed: list[list[_Element]] = []
    for begin, end, _ in regions:
        parsed.append(_parse(journal[begin:end], begin, share))
    out: list[tuple[Any, ...]] = []
    moved: dict[int, int] = {}
    at = 0
    for begin, end, placeholder in [*regions, (len(journal), len(journal), _STEP)]:
        for event in range(at, begin):
            record = journal[event]
            if record[0] in REFERENCES:
                target = moved.get(record[1])
                if target is None:
                    raise NotReplayable(f"event {event} names an optimizer event")
                record = (record[0], target, *record[2:])
            moved[event] = len(out)
            out.append(record)
        if begin < len(journal):
            out.append(placeholder)
        at = end
    residents = parsed[0] if states else None
    return Zero1Cut(out, residents, parsed[-1])


def splice(
    deep: Sequence[tuple[Any, ...]], zero1: Zero1Cut, share: RankShare
) -> list[tuple[Any, ...]]:
    """The deep journal (`expand`'s of `zero1.journal`) with the deep rank's optimizer events
    (`share`: the deep partition's) in place of the placeholders.

    Raises:
        NotReplayable: a placeholder is missing."""
    out: list[tuple[Any, ...]] = []
    moved: list[int] = []
    found = 0
    for record in deep:
        if record is _RESIDENTS or record is _STEP:
            elements = zero1.residents if record is _RESIDENTS else zero1.step
            assert elements is not None
            out += _write(elements, share, len(out))
            moved.append(-1)
            found += 1
            continue
        if record[0] in REFERENCES:
            record = (record[0], moved[record[1]], *record[2:])
        moved.append(len(out))
        out.append(record)
    if found != 1 + (zero1.residents is not None):
        raise NotReplayable("the deep journal lost the optimizer's placeholders")
    return out


__all__ = [
    "ParameterSize",
    "PartitionBytes",
    "RankShare",
    "Zero1Cut",
    "cut",
    "deep_parameters",
    "rank_share",
    "splice",
]
