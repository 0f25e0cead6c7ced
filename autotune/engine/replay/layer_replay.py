"""The estimate's layer replay: a deep decoder's traced step built from a shallow one's.

A decoder's layers are one module class with one configuration, so each runs the same ops on
the same shapes: the step of a model of N layers is the step of a model of `TRACED_LAYERS`
layers with the middle layers' events repeated. `LayerReplay` traces the shallow model (same
config but the depth), journals every allocation, free and op with the layer it belongs to
(`autotune.engine.emulation.layer_journal`), writes the deep model's journal from it
(`expand`), and replays that through a fresh model of the caching allocator at the emulated
GPU's capacity (`evaluate`): the same peaks, out-of-memory, per-op live bytes and allocation
trace as the deep model's own trace, at the cost of a five-layer trace
(docs/design.md#the-layer-replay). Under partial checkpointing (the first k layers
checkpointed, the others plain) the middle layers are of two kinds, and a model of
`PARTIAL_TRACED_LAYERS` layers is traced with its first few checkpointed
(`autotune.engine.replay.layer_plan`).

The rule `expand` applies, and what it checks before it trusts it:

* the journal splits into runs of consecutive events of one owner (a layer or none), and every
  run of a layer stands in a sweep: the runs of layers 0, 1, ..., d-1 back to back, or
  d-1, ..., 0 (a forward, a backward, an optimizer op over all parameters);
* in every sweep the layers of each repeated run of middle layers of one kind (the plan's;
  1 .. d-2 when all are of one kind) are identical: the same allocations, ops and phases, each
  free naming the same position of the run the same number of layers away (or the same event
  outside the layers), but for frees of a neighbour outside the run;
* the deep journal repeats each sweep with each deep layer's template run in its place
  (`LayerPlan.templates`: layer 0's run first, or last, then each run's first traced layer,
  its pure one once per layer between, its last); a free of the deep journal names the event
  its template named, in the layer as far from its own, only where that layer repeats the
  traced layer the template named (or one of the same repeated run), and only where the
  shallow journal showed a free of that kind (a middle layer freeing its neighbour's output,
  say).

Anything else raises `NotReplayable`, and the estimate traces the deep model itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch
from torch import nn

from autotune.core.gpus.cuda_reserve import GpuBudget
from autotune.core.gpus.roofline import RooflineAssumptions
from autotune.core.memory.allocator import AllocatorOutOfMemory, CachingAllocator
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.memory.gradient_buckets import BucketTensor
from autotune.core.memory.optimizer_states import FSDP2_SHARDINGS
from autotune.core.memory.resident_placement import ResidentPlacement, TrialStart
from autotune.core.parallel.layouts import ModelParameters
from autotune.core.schemas import OOM_OP_MAX, OomDetail, Phase, Sharding, Spec, StepOutcome
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.emulation.attention import fused_calls
from autotune.engine.emulation.layer_journal import (
    ALLOC,
    BUCKET,
    FIXED,
    FREE,
    GRAD,
    HOLD,
    MARK,
    NO_LAYER,
    OP,
    OPTIMIZER_STATE,
    REFERENCES,
    UNGRAD,
    WEIGHT,
    JournalTracker,
    LayerContexts,
    NotReplayable,
    parameter_tags,
    storage_key,
)
from autotune.engine.kernel_times import SpeedPass
from autotune.engine.replay.layer_buckets import BucketLayout, JournalBuckets, LayerBuckets
from autotune.engine.replay.layer_plan import LayerPlan, partial_plan, uniform_plan
from autotune.engine.replay.layer_speed import LayerKernelTimes
from autotune.engine.replay.layer_zero1 import (
    ParameterSize,
    PartitionBytes,
    RankShare,
    cut,
    deep_parameters,
    rank_share,
    splice,
)
from autotune.engine.replay.microstep_replay import TRACED_MICRO_STEPS, StepMarks, write_out
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.data_parallel import EmulatedReducer, trainable_parameters
from autotune.engine.training.sharding import model_parameters

logger = logging.getLogger(__name__)

# The depth of the traced model: the first and last layers may differ from the others (the
# first reads the embeddings, which need no gradient under LoRA; the last feeds the final
# norm), and two middle layers show what a middle layer does beside another middle layer.
TRACED_LAYERS = 5
# The depth of the model traced for partial checkpointing: two ends and two runs of middle
# layers (checkpointed, plain) of three layers each, or one run traced whole and the other
# shortened (`autotune.engine.replay.layer_plan.partial_plan`).
PARTIAL_TRACED_LAYERS = 8


def owners(journal: Sequence[tuple[Any, ...]]) -> list[int | None]:
    """Each event's layer (None: no layer's). Outside the layers an event is its tag's; an
    untagged one goes with the event before it outside the layers; a free or a gradient's
    completion outside the layers goes with its allocation."""
    result: list[int | None] = []
    sticky: int | None = None
    last_layer = NO_LAYER  # the layer context of the last allocation or op
    for record in journal:
        kind = record[0]
        if kind == MARK:
            last_layer = record[1]
            if last_layer == NO_LAYER:
                sticky = None
            result.append(None if last_layer == NO_LAYER else last_layer)
            continue
        if kind in REFERENCES:
            context = record[2]
            if context == NO_LAYER:
                # Between two layers (the previous layer's output dropped as the next one
                # starts) a free goes with the layer that just ran; elsewhere (the gradients'
                # release) with its allocation; and so do the other records naming one.
                context = last_layer if last_layer != NO_LAYER else result[record[1]]
            result.append(context)
            continue
        context, tag = (record[2], record[3]) if kind == ALLOC else (record[1], record[2])
        last_layer = context
        if context != NO_LAYER:
            result.append(context)
            continue
        owner = tag if tag >= 0 else (None if tag == FIXED else sticky)
        sticky = owner
        result.append(owner)
    return result


@dataclass(frozen=True)
class _Sweep:
    first: int  # the first traced layer it sweeps over (all of them, or a plan's span)
    runs: tuple[tuple[int, int], ...]  # per layer of the shallow model from `first`: [start, end)
    ascending: bool

    @property
    def layers(self) -> range:
        return range(self.first, self.first + len(self.runs))


def _sweep_at(
    runs: Sequence[tuple[int | None, int, int]], index: int, spans: Sequence[tuple[int, int]]
) -> _Sweep | None:
    """The sweep `runs[index]` starts (a run per layer of one of `spans`, in either order; the
    longest span first), or None."""
    for first, last in spans:
        group = runs[index : index + last - first + 1]
        layers = [run[0] for run in group]
        ascending: list[int | None] = list(range(first, last + 1))
        if layers in (ascending, ascending[::-1]):
            by_layer = sorted(group, key=lambda run: run[0] or 0)
            return _Sweep(first, tuple((run[1], run[2]) for run in by_layer), layers == ascending)
    return None


def expand(
    journal: Sequence[tuple[Any, ...]], plan: LayerPlan, buckets: JournalBuckets | None = None
) -> list[tuple[Any, ...]]:
    """The journal of the same step with `plan.depth` layers instead of `plan.traced_layers`,
    each deep layer repeating its template's run (module docstring,
    `autotune.engine.replay.layer_plan`). Records keep their shape; a free's or gradient's
    reference
    is renumbered. DDP's buckets (`buckets`; allocations of category BUCKET) are the deep
    model's: the shallow journal's resident buckets are replaced by their deep layout, and a
    gradient that becomes a view of one names its deep parameter's bucket
    (`autotune.engine.replay.layer_buckets`).

    Raises:
        NotReplayable: the journal does not have the structure the rule needs.
    """
    depth = plan.traced_layers
    target_depth = plan.depth
    owner_of = owners(journal)
    bucket_events = _bucket_allocations(journal, buckets)
    deep_buckets: list[int] = []  # the deep buckets' places in the output
    # Runs of one owner, then segments: a run outside the layers, or a sweep.
    runs: list[tuple[int | None, int, int]] = []
    start = 0
    for index in range(1, len(journal) + 1):
        if index == len(journal) or owner_of[index] != owner_of[start]:
            runs.append((owner_of[start], start, index))
            start = index
    segments: list[tuple[int, int] | _Sweep] = []
    location: dict[int, tuple[int, int, int]] = {}  # event -> (sweep segment, layer, position)
    index = 0
    # A sweep covers all layers, or a span of the plan's (the checkpointed layers' casts,
    # dropped from autocast's cache as the forward ends, under partial checkpointing); the
    # longest that matches.
    spans = sorted(plan.spans, key=lambda span: span[0] - span[1])
    while index < len(runs):
        owner, first, end = runs[index]
        if owner is None:
            segments.append((first, end))
            index += 1
            continue
        sweep = _sweep_at(runs, index, spans)
        if sweep is None:
            if owner in (0, depth - 1):
                # Events of the first or last layer's tensors outside any sweep (the last
                # layer's output, dropped after the final norm; FSDP2's root unit prefetching
                # the last layer's parameters as the backward starts): events outside the
                # layers that the deep model has too, for its own first or last layer.
                segments.append((first, end))
                index += 1
                continue
            layers = [run[0] for run in runs[index : index + depth]]
            raise NotReplayable(f"a sweep over layers {layers[:8]} at event {first}")
        for layer, (run_start, run_end) in zip(sweep.layers, sweep.runs, strict=True):
            for position, event in enumerate(range(run_start, run_end)):
                location[event] = (len(segments), layer, position)
        segments.append(sweep)
        index += len(sweep.runs)

    if any(event in location for event in bucket_events):
        raise NotReplayable("a bucket allocated in a sweep over the layers")

    def relative(event: int, layer: int) -> tuple[Any, ...]:
        record = journal[event]
        kind = record[0]
        if kind == ALLOC:
            return (ALLOC, record[1], record[4], record[5])
        if kind == OP:
            return (OP, record[3], record[4], record[5])
        if kind == MARK:
            return (MARK,)
        if record[1] in bucket_events:
            if kind == FREE or buckets is None:
                raise NotReplayable(f"event {event} frees a bucket")
            return (kind, _BUCKET, buckets.parameters.slot(record[3]))
        target = location.get(record[1])
        if target is None:
            return (kind, "fixed", record[1])
        return (kind, target[0], target[1] - layer, target[2])

    # The layers of a repeated run must be one run: the same events in the same order, each
    # free naming the same position as far away. A free naming a layer outside the run (an
    # end, a layer of the other kind) is only compared with the pure layer's (between two of
    # the run) free at the same distance, whose target is in the run: the layers outside may
    # be laid out otherwise, and the deep model's layers next to them repeat the run's first
    # and last traced layers, where those frees were traced.
    templates: dict[int, dict[int, list[tuple[Any, ...]]]] = {}
    for number, segment in enumerate(segments):
        if not isinstance(segment, _Sweep):
            continue
        described = {
            layer: [relative(event, layer) for event in range(*run)]
            for layer, run in zip(segment.layers, segment.runs, strict=True)
        }
        for middle in plan.repeated:
            if middle[0] in described:  # a span holds a run whole or not at all
                _check_one_run(described, middle, number)
        templates[number] = described

    out: list[tuple[Any, ...]] = []
    renumbered_fixed: dict[int, int] = {}
    # Where each written-out event of a sweep went: (segment, deep layer, position) -> its
    # place in `out`; a deep layer's run written out whole from its template's program is
    # kept as its first place (`bases`), its events following it one by one.
    renumbered: dict[tuple[int, int, int], int] = {}
    bases: dict[tuple[int, int], tuple[int, int]] = {}  # ... -> (first place, events)
    programs: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    repeated: dict[tuple[int, int], bool] = {}

    def repeats(deep_layer: int, traced_layer: int) -> bool:
        known = repeated.get((deep_layer, traced_layer))
        if known is None:
            known = repeated[(deep_layer, traced_layer)] = plan.repeats(deep_layer, traced_layer)
        return known

    def placed(number: int, layer: int, position: int) -> int | None:
        written = bases.get((number, layer))
        if written is None:
            return renumbered.get((number, layer, position))
        base, length = written
        target = base + position
        # None past the run, or not yet written out (a later event of the run being written).
        return target if position < length and target < len(out) else None

    def rewritten(
        record: tuple[Any, ...], event: int, item: tuple[Any, ...], source: int, layer: int
    ) -> tuple[Any, ...]:
        """A record of deep `layer` (repeating traced `source`) that names another event
        (its template's `item`), naming that event's place in the deep journal."""
        if record[0] in (FREE, GRAD) and item[1] == _BUCKET:
            assert buckets is not None
            owner = buckets.parameters.layer_of(record[3])
            if owner is None and source in (0, depth - 1):
                # The first layer's backward goes on into the embeddings'.
                deep_owner = None
            elif owner == source:
                deep_owner = layer
            else:
                raise NotReplayable(f"event {event}: another layer's gradient")
            return _bucket_gradient(record, deep_owner, buckets, deep_buckets)
        if item[1] == "fixed":
            target = renumbered_fixed.get(item[2])
        elif source in (0, depth - 1) and abs(item[2]) > 1:
            # The first or last layer naming a layer further than its neighbour, alone:
            # which of the deep model's layers that is the trace cannot say.
            raise NotReplayable(f"event {event} names a layer {item[2]} away")
        elif repeats(layer + item[2], source + item[2]):
            target = placed(item[1], layer + item[2], item[3])
        else:
            # The deep layer it names does not repeat the traced one.
            target = None
        if target is None:
            raise NotReplayable(f"event {event} names an event not yet replayed")
        return (record[0], target, *record[2:])

    for number, segment in enumerate(segments):
        if not isinstance(segment, _Sweep):
            for event in range(*segment):
                record = journal[event]
                if event in bucket_events:
                    # The first of the resident buckets' allocations stands for all of them:
                    # the deep buckets' in their place.
                    if not deep_buckets:
                        assert buckets is not None
                        for nbytes in buckets.layout.sizes_bytes:
                            deep_buckets.append(len(out))
                            out.append((record[0], nbytes, *record[2:]))
                    continue
                if record[0] in (FREE, GRAD) and record[1] in bucket_events:
                    owner = _end_layer(buckets, record, event, depth, target_depth)
                    out.append(_bucket_gradient(record, owner, buckets, deep_buckets))
                    renumbered_fixed[event] = len(out) - 1
                    continue
                if record[0] in REFERENCES:
                    target = renumbered_fixed.get(record[1])
                    place = location.get(record[1])
                    if place is not None and place[1] in (0, depth - 1):
                        layer = 0 if place[1] == 0 else target_depth - 1
                        target = placed(place[0], layer, place[2])
                    if target is None:
                        raise NotReplayable(f"event {event} names a middle layer's event")
                    record = (record[0], target, *record[2:])
                renumbered_fixed[event] = len(out)
                out.append(record)
            continue
        deep = plan.deep_layers(segment.layers)
        for layer in deep if segment.ascending else reversed(deep):
            source = plan.templates[layer]
            run_start, run_end = segment.runs[source - segment.first]
            template = templates[number][source]
            fans = _fans(template, source, depth)
            if not fans:
                # Most deep layers repeat a middle layer's run: written out from its program.
                key = (number, source)
                program = programs.get(key)
                if program is None:
                    program = programs[key] = _program(journal, run_start, template)
                bases[(number, layer)] = (len(out), run_end - run_start)
                for step in program:
                    if step[0] is None:
                        out += step[1]
                        continue
                    _, event, item, record = step
                    out.append(rewritten(record, event, item, source, layer))
                continue
            position = 0
            while position < run_end - run_start:
                event = run_start + position
                record = journal[event]
                fan = fans.get(position)
                if fan is not None:
                    # The first (last) layer freeing an event of every other layer: the deep
                    # model's frees it of each of its other layers, in the same order.
                    others = [other for other in range(target_depth) if other != layer]
                    if fan[0][1] > fan[-1][1]:
                        others.reverse()
                    at = {target_layer: (seg, pos) for seg, target_layer, pos in fan}
                    for other in others:
                        seg, pos = at[plan.templates[other]]
                        target = placed(seg, other, pos)
                        if target is None:
                            raise NotReplayable(f"event {event} names an event not yet replayed")
                        out.append((record[0], target, *record[2:]))
                    for skipped in range(len(fan)):
                        renumbered[(number, layer, position + skipped)] = len(out) - 1
                    position += len(fan)
                    continue
                if record[0] in REFERENCES:
                    record = rewritten(record, event, template[position], source, layer)
                renumbered[(number, layer, position)] = len(out)
                out.append(record)
                position += 1
    return out


# A relative record's mark: a gradient that became a view of a bucket.
_BUCKET = "bucket"


def _program(
    journal: Sequence[tuple[Any, ...]], start: int, template: Sequence[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    """How `expand` writes out a run of the shallow journal (from `start`, its events'
    `template`) for each deep layer that repeats it: (None, records) for records copied as they
    are (allocations, ops, markers), (REFERENCE, event, item, record) for one naming another,
    renumbered per deep layer. A middle layer's run is written out once per deep layer (76
    times for a 70B model), so what does not depend on the layer is worked out once."""
    program: list[tuple[Any, ...]] = []
    copied: list[tuple[Any, ...]] = []
    for position, item in enumerate(template):
        event = start + position
        record = journal[event]
        if record[0] in REFERENCES:
            if copied:
                program.append((None, tuple(copied)))
                copied = []
            program.append((_REFERENCE, event, item, record))
        else:
            copied.append(record)
    if copied:
        program.append((None, tuple(copied)))
    return program


_REFERENCE = "reference"


def _bucket_allocations(
    journal: Sequence[tuple[Any, ...]], buckets: JournalBuckets | None
) -> set[int]:
    """The resident buckets' allocations: back to back, before the step (DDP's reducer
    rebuilds due buckets between steps, so a step allocates none).

    Raises:
        NotReplayable: buckets without `buckets`, none with them, or allocations other than
            one run of them.
    """
    allocations = [i for i, r in enumerate(journal) if r[0] == ALLOC and r[5] == BUCKET]
    if (buckets is None) != (not allocations):
        raise NotReplayable("the journal's buckets are not the reducer's")
    if allocations and allocations[-1] - allocations[0] != len(allocations) - 1:
        raise NotReplayable("buckets allocated apart from the residents'")
    return set(allocations)


def _end_layer(
    buckets: JournalBuckets | None,
    record: tuple[Any, ...],
    event: int,
    depth: int,
    target_depth: int,
) -> int | None:
    """Outside the sweeps, the deep layer of a gradient that became a bucket's view: none for
    a parameter outside the layers, the first or last layer's for theirs."""
    assert buckets is not None
    if record[0] == FREE:
        raise NotReplayable(f"event {event} frees a bucket")
    layer = buckets.parameters.layer_of(record[3])
    if layer is None:
        return None
    if layer not in (0, depth - 1):
        raise NotReplayable(f"event {event}: a middle layer's gradient outside the layers")
    return 0 if layer == 0 else target_depth - 1


def _bucket_gradient(
    record: tuple[Any, ...],
    deep_layer: int | None,
    buckets: JournalBuckets | None,
    deep_buckets: list[int],
) -> tuple[Any, ...]:
    """A gradient record naming a shallow bucket, renamed to the deep bucket of the deep
    parameter it stands for in `deep_layer`."""
    assert buckets is not None
    if not deep_buckets:
        raise NotReplayable("a gradient names a bucket not yet allocated")
    parameter = buckets.parameters.deep_parameter(record[3], deep_layer)
    return (record[0], deep_buckets[buckets.layout.bucket_of[parameter]], *record[2:])


def _check_one_run(
    described: dict[int, list[tuple[Any, ...]]], middle: tuple[int, ...], number: int
) -> None:
    """Raises NotReplayable unless the traced layers `middle` (a repeated run) show one run in
    sweep `number` (`described`: each traced layer's events, relative)."""
    pure = LayerPlan.pure(middle)
    reference = described[pure]
    for layer in middle:
        run = described[layer]
        if len(run) != len(reference):
            raise NotReplayable(f"the middle layers' runs differ in length in sweep {number}")
        for mine, theirs in zip(run, reference, strict=True):
            if mine == theirs:
                continue
            if (
                mine[0] in REFERENCES
                and mine[:3] == theirs[:3]
                and mine[1] not in ("fixed", _BUCKET)
                and abs(mine[2]) == 1
                and layer + mine[2] not in middle
                and pure + theirs[2] in middle
            ):
                continue
            raise NotReplayable(f"the middle layers' events differ in sweep {number}")
    for item in reference:
        if (
            item[0] in REFERENCES
            and item[1] not in ("fixed", _BUCKET)
            and pure + item[2] not in middle
        ):
            raise NotReplayable(f"a middle layer names a layer outside its run in {number}")


def _fans(
    template: Sequence[tuple[Any, ...]], source: int, depth: int
) -> dict[int, list[tuple[int, int, int]]]:
    """In the first or last layer's run (`source`) of a sweep: each place where it frees, one
    after the other, an event of every other layer in layer order (FSDP2's hybrid sharding
    drops every layer's gradient all-reduce state as the backward ends), by its first
    position: the (segment, layer, position) each names."""
    fans: dict[int, list[tuple[int, int, int]]] = {}
    if source not in (0, depth - 1):
        return fans
    others = [layer for layer in range(depth) if layer != source]
    width = depth - 1
    position = 0
    while position + width <= len(template):
        items = template[position : position + width]
        if all(item[0] == FREE and item[1] != "fixed" for item in items):
            named = [(item[1], source + item[2], item[3]) for item in items]
            layers = [layer for _, layer, _ in named]
            if layers in (others, others[::-1]) and len({seg for seg, _, _ in named}) == 1:
                fans[position] = named
                position += width
                continue
        position += 1
    return fans


def _rounded(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes) * block_bytes


def evaluate(
    journal: Sequence[tuple[Any, ...]],
    *,
    micro_batch: int,
    limit_bytes: int,
    allocator_config: AllocatorConfig | None,
    device_total_bytes: int,
    block_bytes: int,
    placement: ResidentPlacement | None = None,
) -> StepOutcome:
    """The outcome of the step `journal` records on the emulated GPU: the allocations replayed
    in order through a fresh caching allocator of `limit_bytes`, as the emulated device's
    tracker mallocs and frees them (`autotune.engine.devices.device.EmulatedDevice`), and the
    live bytes, phase peaks and out-of-memory as the tracker counts them. With `placement`,
    the residents (the allocations before the journal's first marker, which the tracker
    writes after them) start where the warm-up left them, as on the device after its
    warm-up."""
    allocator = CachingAllocator(
        limit_bytes, allocator_config, device_total_bytes=device_total_bytes
    )
    placed: list[Any] = []
    start: TrialStart | None = None
    if placement is not None:
        residents = next((i for i, record in enumerate(journal) if record[0] == MARK), 0)
        sizes = [record[1] for record in journal[:residents]]
        if any(record[0] != ALLOC for record in journal[:residents]):
            raise NotReplayable("the residents' allocations are not the journal's first")
        start = TrialStart(placement, len(sizes))
        try:
            placed = placement.place(allocator, sizes)
        except AllocatorOutOfMemory as error:
            return StepOutcome.of_allocator(
                micro_batch,
                allocator.stats,
                phase_peak_bytes={},
                oom_phase=journal[0][4],
                oom=_oom_detail(journal, 0, error, {}, set(), {}),
                series=None,
                allocations=None,
            )
        placed.reverse()
    live_bytes = 0
    blocks: dict[int, tuple[Any, int, int]] = {}  # journal index -> (block, bytes, category)
    gradients: set[int] = set()
    # Allocations registered on the model as weights, or not, otherwise than their category
    # says (FSDP2's swaps of a block's shards and gathered parameters).
    registered: dict[int, bool] = {}
    position: dict[int, int] = {}  # journal index of an allocation -> its allocation event
    series: list[int] = []
    allocations: list[int] = []
    phase_peak_bytes: dict[Phase, int] = {}
    oom_phase: Phase | None = None
    oom: OomDetail | None = None
    # A deep journal is some 170,000 records (an 80-layer step): the loop's names are local.
    malloc, free = allocator.malloc, allocator.free
    add_to_series, add_allocation = series.append, allocations.append
    for index, record in enumerate(journal):
        kind = record[0]
        if kind == OP:
            if record[4] and live_bytes > phase_peak_bytes.get(record[3], -1):
                phase_peak_bytes[record[3]] = live_bytes
            add_to_series(live_bytes)
        elif kind == ALLOC:
            nbytes = record[1]
            try:
                block = placed.pop() if placed else malloc(nbytes)
            except AllocatorOutOfMemory as error:
                oom_phase = record[4]
                oom = _oom_detail(journal, index, error, blocks, gradients, registered)
                break
            counted = -(-nbytes // block_bytes) * block_bytes  # `_rounded`
            blocks[index] = (block, counted, record[5])
            live_bytes += counted
            position[index] = len(allocations)
            add_allocation(nbytes)
        elif kind == FREE:
            block, counted, _ = blocks.pop(record[1])
            gradients.discard(record[1])
            free(block)
            live_bytes -= counted
            add_allocation(-(position[record[1]] + 1))
        elif kind == MARK:
            continue
        elif kind == GRAD:
            gradients.add(record[1])
        elif kind == UNGRAD:
            gradients.discard(record[1])
        else:
            registered[record[1]] = kind == HOLD
    return StepOutcome.of_allocator(
        micro_batch,
        allocator.stats,
        phase_peak_bytes=phase_peak_bytes,
        oom_phase=oom_phase,
        oom=oom,
        series=series,
        allocations=allocations,
        start=start,
    )


def _oom_detail(
    journal: Sequence[tuple[Any, ...]],
    failed: int,
    error: AllocatorOutOfMemory,
    blocks: dict[int, tuple[Any, int, int]],
    gradients: set[int],
    registered: dict[int, bool],
) -> OomDetail:
    """What the tracker's `oom` says at the allocation `failed`: its op (the next op's record;
    the resident tensors before the first), and the live weights (registered on the model:
    `registered`, else by category), gradients and optimizer state."""
    op: object = "the step's resident tensors"
    for record in journal[failed:]:
        if record[0] == OP:
            op = record[5]
            break
    if not any(record[0] == OP for record in journal[:failed]):
        op = "the step's resident tensors"
    weights = sum(
        b
        for i, (_, b, c) in blocks.items()
        if registered.get(i, c == WEIGHT) and i not in gradients
    )
    state = sum(b for i, (_, b, c) in blocks.items() if c == OPTIMIZER_STATE)
    grads = sum(blocks[i][1] for i in gradients if i in blocks)
    allocated = error.allocated_bytes
    return OomDetail(
        allocation_bytes=error.allocation_bytes,
        phase=journal[failed][4],
        op=str(op)[:OOM_OP_MAX],
        weights_bytes=weights,
        gradients_bytes=grads,
        optimizer_state_bytes=state,
        activations_bytes=max(0, allocated - weights - grads - state),
        cache_bytes=max(0, error.reserved_bytes - error.allocated_bytes),
    )


# ---------------------------------------------------------------------------------------------
# The shallow model's trace, and when a spec may be replayed at all.

_DEPTH_KEY = "num_hidden_layers"
# One rank or DDP's (its buckets laid out for the deep model,
# `autotune.engine.replay.layer_buckets`),
# and FSDP2's layouts: every decoder layer its own unit (`autotune.engine.training.sharding`).
# ZeRO-1's ranks are DDP's with the optimizer's events of the deep model's partition
# (`autotune.engine.replay.layer_zero1`).
_REPLAYED_SHARDINGS = (
    Sharding.NONE,
    Sharding.ZERO1,
    Sharding.ZERO2,
    Sharding.ZERO3,
    Sharding.HYBRID,
)
_SIMPLE = (int, float, str, bool, type(None))


def _layer_signature(layer: nn.Module) -> tuple[Any, ...]:
    """What makes two decoder layers run the same ops on the same shapes: their modules'
    classes, parameter and buffer shapes and dtypes, and plain attributes (a sliding window,
    an attention type, a dense or expert MLP), all but the layer's own index."""
    signature: list[Any] = []
    for name, module in layer.named_modules():
        attributes = tuple(
            sorted(
                (key, value)
                for key, value in vars(module).items()
                if not key.startswith("_") and key != "layer_idx" and isinstance(value, _SIMPLE)
            )
        )
        tensors = tuple(
            (key, tuple(t.shape), t.dtype, t.requires_grad)
            for key, t in (
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            )
            if t is not None
        )
        signature.append((name, type(module).__qualname__, attributes, tensors))
    return tuple(signature)


def replay_depth(spec: Spec) -> int | None:
    """The depth to replay `spec`'s model at, or None when its step must be traced whole: only
    a transformers config (a factory's blocks may be anything), one rank, DDP's ranks (ZeRO-1's
    too, its optimizer's partition written out for the depth), FSDP2's sharded ranks (zero2,
    zero3, hybrid), deeper than the traced model plus two, and only when all of its layers
    are the same layer (`_layer_signature`, read from the model built on the meta device:
    per-layer settings such as `layer_types`, a first dense layer of a mixture-of-experts, or
    a sliding window on some layers make them differ)."""
    config = spec.model.hf_config
    training = spec.training
    if config is None or training.sharding not in _REPLAYED_SHARDINGS:
        return None
    depth = config.get(_DEPTH_KEY)
    if not isinstance(depth, int) or depth < TRACED_LAYERS + 2:
        return None
    transformers = importlib.import_module("transformers")
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        hf_config.use_cache = False
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config, attn_implementation="sdpa"
            )
    except Exception:  # noqa: BLE001 - the whole trace reports the build's own error
        return None
    layer_class = getattr(
        importlib.import_module("transformers.modeling_layers"), "GradientCheckpointingLayer", None
    )
    if layer_class is None:
        return None
    layers = [m for m in model.modules() if isinstance(m, layer_class)]
    if len(layers) != depth:
        return None
    first = _layer_signature(layers[0])
    if any(_layer_signature(layer) != first for layer in layers[1:]):
        return None
    return depth


class _GradientRecorder(Protocol):
    def record_gradient(self, parameter: torch.Tensor, tag: int, number: int = -1) -> None: ...


class _Placed(Enum):
    """Where a replayed trial starts when not told: as the device's trials do."""

    DEVICES = "the device's"


class LayerReplay:
    """Trials of a deep model by the layer replay (module docstring): `device` is the emulated
    GPU the estimate is for; the shallow model, of `traced_layers` layers, runs on a twin of it
    that never runs out. `PARTIAL_TRACED_LAYERS` of them replay partial checkpointing too."""

    def __init__(
        self,
        spec: Spec,
        device: EmulatedDevice,
        depth: int,
        *,
        traced_layers: int = TRACED_LAYERS,
        allowed_factory_prefixes: list[str] | None = None,
    ) -> None:
        assert spec.model.hf_config is not None
        shallow = spec.model_copy(
            update={
                "model": spec.model.model_copy(
                    update={"hf_config": {**spec.model.hf_config, _DEPTH_KEY: traced_layers}}
                )
            }
        )
        self.depth = depth
        self.traced_layers = traced_layers
        self.device = device
        twin = EmulatedDevice(
            device.capacity_bytes if device.gpu is None else None,
            gpu=device.gpu,
            block_bytes=device.block_bytes,
            allocator_config=device.allocator_config,
            model_allocator=False,
        )
        # The shallow step's journal does not depend on the allocator; it must only never run
        # out, so that it is whole.
        twin.capacity_bytes = _UNBOUNDED_BYTES
        twin.make_tracker = self._make_tracker
        self._twin = twin
        self.runner = InProcessRunner(
            shallow, twin, allowed_factory_prefixes=allowed_factory_prefixes
        )
        partial = self.runner.workload.partial_checkpointing
        layers: list[nn.Module] = getattr(partial, "layers", [])
        if len(layers) != traced_layers:
            raise NotReplayable(f"the traced model has {len(layers)} layers")
        first = _layer_signature(layers[0])
        if any(_layer_signature(layer) != first for layer in layers[1:]):
            raise NotReplayable("the traced model's layers differ")
        self.layers = layers
        self.contexts = LayerContexts(layers)
        self._tracker: JournalTracker | None = None
        # Who hears of each completed gradient: the journal's tracker in a trial, the kernel
        # times in a speed pass.
        self._gradients: _GradientRecorder | None = None
        # A speed pass asked for along with the next trial's shallow step (`timed_along`),
        # and its kernel times while that step runs.
        self._along: TimedAlong | None = None
        self._timed: LayerKernelTimes | None = None
        self._tags: dict[int, int] = {}
        self._categories: dict[int, int] = {}
        # Once warm, the shallow journals by the shallow step: partial checkpointing of many
        # counts runs one shallow step (`partial_plan`: both runs shortened to 3 layers), so
        # each count is written out from the one trace (docs/design.md#the-layer-replay).
        self._warm = False
        self._journals: dict[_ShallowKey, _ShallowJournal] = {}
        # A step of more micro-steps than `TRACED_MICRO_STEPS` is written out from one of that
        # many (`autotune.engine.replay.microstep_replay`) on one rank and on FSDP2's ranks
        # (every micro-step reduce-scatters its gradients; what only the last does comes
        # after it); DDP's ranks trace theirs (their last micro-step synchronises, inside it).
        # Where each unit of the traced step starts: a batch's making, its count, a micro-step.
        self._microstep_replay = spec.training.sharding in FSDP2_SHARDINGS or (
            spec.training.world_size == 1 and spec.training.sharding is Sharding.NONE
        )
        self._unit_starts: tuple[list[int], ...] | None = None
        workload = self.runner.workload
        for unit, name in enumerate(_UNIT_CALLS):
            setattr(workload, name, self._marked(unit, getattr(workload, name)))
        _, _, by_parameter = parameter_tags(layers, self.runner.step.model, {})
        # Each trainable parameter's number is its place in DDP's order (module by module).
        trainable = trainable_parameters(self.runner.step.model)
        numbers = {id(parameter): number for number, parameter in enumerate(trainable)}
        for parameter in self.runner.step.model.parameters():
            if parameter.requires_grad:
                hook = functools.partial(
                    self._gradient,
                    by_parameter.get(id(parameter), FIXED),
                    numbers.get(id(parameter), -1),
                )
                parameter.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        # DDP's ranks: the deep model's buckets (`autotune.engine.replay.layer_buckets`).
        self.reducer: EmulatedReducer | None = self.runner.step.reducer
        self.buckets: LayerBuckets | None = None
        # ZeRO-1's ranks: the shallow and the deep rank's share of the parameters.
        self.zero1: tuple[RankShare, RankShare] | None = None
        if self.reducer is not None:
            if any(True for layer in layers for _ in layer.buffers()):
                # The buffers DDP flattens to broadcast would be the deep model's.
                raise NotReplayable("DDP with buffers in the layers")
            tags = [by_parameter.get(id(parameter), FIXED) for parameter in trainable]
            self.buckets = LayerBuckets(
                [
                    BucketTensor(p.numel() * p.element_size(), (p.dtype, p.device))
                    for p in trainable
                ],
                [None if tag < 0 else tag for tag in tags],
                traced_layers,
                depth,
            )
            if spec.training.sharding is Sharding.ZERO1:
                self.zero1 = self._zero1_shares(by_parameter, spec.training.world_size)
            # The step states the buckets' bytes: the deep model's.
            step = self.runner.step
            world_size = spec.training.world_size
            deep_bytes = sum(self.buckets.construction().sizes_bytes)
            step.assumptions = (
                self.reducer.assumption(world_size, bucket_bytes=deep_bytes),
                *step.assumptions[1:],
            )

    def _marked(self, unit: int, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` (a workload's call made once per micro-step), noting where its unit starts in
        the journal of a step being traced."""

        def marked(*args: Any, **kwargs: Any) -> Any:
            starts, tracker = self._unit_starts, self._tracker
            if starts is not None and tracker is not None:
                starts[unit].append(len(tracker.journal))
            return call(*args, **kwargs)

        return marked

    def _zero1_shares(
        self, by_parameter: dict[int, int], world_size: int
    ) -> tuple[RankShare, RankShare]:
        """The shallow rank's share of the parameters (checked against its optimizer's) and
        the deep rank's, as `ZeroRedundancyOptimizer` partitions them.

        Raises:
            NotReplayable: the optimizer's partition is not the one computed, or the
                parameters are not one block per layer.
        """
        optimizer = self.runner.step.optimizer
        groups = optimizer.param_groups
        local_groups = getattr(optimizer, "optim", optimizer).param_groups
        if len(groups) != 1 or len(local_groups) != 1:
            raise NotReplayable("ZeRO-1 with several parameter groups")
        every = list(groups[0]["params"])
        sizes = [
            ParameterSize(
                p.numel(),
                p.numel() * p.element_size(),
                None if by_parameter.get(id(p), FIXED) < 0 else by_parameter[id(p)],
            )
            for p in every
        ]
        shallow = rank_share(sizes, world_size)
        numbers = {id(p): number for number, p in enumerate(every)}
        if tuple(numbers.get(id(p), -1) for p in local_groups[0]["params"]) != shallow.local:
            raise NotReplayable("the rank's partition is not the one computed")
        deep = rank_share(deep_parameters(sizes, self.traced_layers, self.depth), world_size)
        return shallow, deep

    def model_parameters(self) -> ModelParameters:
        """The deep model's parameters as FSDP2's units hold them (one unit per layer, then the
        root: `autotune.engine.training.sharding.model_parameters`), for the communication
        model: the shallow model's, its layer unit once per layer and its layers' buffers
        counted for the deep model's layers.

        Raises:
            NotReplayable: the shallow model's units are not one per layer and the root, or
                its layers' units differ.
        """
        shallow = model_parameters(self.runner.step.model)
        *layer_units, root = shallow.units
        if len(layer_units) != TRACED_LAYERS or any(u != layer_units[0] for u in layer_units):
            raise NotReplayable("the traced model's units are not one per layer")
        layer_buffer_bytes = sum(b.numel() * b.element_size() for b in self.layers[0].buffers())
        return ModelParameters(
            units=(*[layer_units[0]] * self.depth, root),
            buffer_bytes=shallow.buffer_bytes + (self.depth - TRACED_LAYERS) * layer_buffer_bytes,
        )

    def _make_tracker(self, *args: Any, **kwargs: Any) -> JournalTracker:
        tracker = JournalTracker(
            *args, contexts=self.contexts, tags=self._tags, categories=self._categories, **kwargs
        )
        self._tracker = tracker
        self._gradients = tracker
        return tracker

    def _gradient(self, tag: int, number: int, parameter: torch.Tensor) -> None:
        if self._gradients is not None:
            self._gradients.record_gradient(parameter, tag, number)
        if self._timed is not None:
            self._timed.record_gradient(parameter, tag, number)

    def _bucket_layout(self) -> BucketLayout | None:
        """The deep model's buckets as the reducer's are now: made with the model, or rebuilt
        in the ready order (None without DDP)."""
        reducer, buckets = self.reducer, self.buckets
        if reducer is None or buckets is None:
            return None
        if reducer.rebuilt:
            return buckets.rebuilt(reducer.ready_order)
        return buckets.construction()

    @contextmanager
    def speed_pass(
        self, budget: GpuBudget, assumptions: RooflineAssumptions, tf32: bool
    ) -> Iterator[LayerKernelTimes]:
        """Kernel times for a speed pass of the shallow model
        (`autotune.engine.replay.layer_speed`):
        the caller runs the shallow step under them, then asks them for the deep model's
        times. The step leaves the shallow model as the whole model's speed pass leaves the
        whole model (an optimizer state it made included)."""
        step = self.runner.step
        optimizer = getattr(step.optimizer, "optim", step.optimizer)
        tags, _, _ = parameter_tags(self.layers, step.model, optimizer.state)
        times = LayerKernelTimes(
            budget,
            assumptions,
            tf32,
            contexts=self.contexts,
            tags=tags,
            depth=self.traced_layers,
            partition=self._partition(),
        )
        self._gradients = times
        try:
            yield times
        except BaseException:
            step.clear_grads()  # a step cut short leaves what the next would accumulate into
            raise
        finally:
            self._gradients = None

    def _partition(self) -> PartitionBytes | None:
        """A ZeRO-1 rank's optimizer runs over its partition: the deep rank's bytes of it."""
        return None if self.zero1 is None else PartitionBytes(*self.zero1, self.depth)

    @contextmanager
    def timed_along(
        self,
        budget: GpuBudget,
        assumptions: RooflineAssumptions,
        tf32: bool,
        shallow: tuple[int, int, bool, int | None],
    ) -> Iterator[TimedAlong]:
        """The speed pass of the shallow step `shallow` (micro-batch, micro-steps,
        checkpointing, checkpointed shallow layers), timed from the trace a trial inside the
        block makes of that step, if one does: the same step, traced once for both
        (docs/design.md#the-layer-replay). `TimedAlong.times` is then the kernel times
        `speed_pass` would have, else None (the step's journal was known, or the step ran
        attention the speed pass times otherwise: `_journal`). The kernel times hold none of
        the step's tensors, so the trial is the one traced alone."""
        along = TimedAlong(budget, assumptions, tf32, shallow)
        self._along = along
        try:
            yield along
        finally:
            self._along = None

    @property
    def writes_out_micro_steps(self) -> bool:
        """Whether a trial of more than `TRACED_MICRO_STEPS` micro-steps traces that many and
        writes the rest out (one rank), rather than tracing its own (a rank of several)."""
        return self._microstep_replay

    @property
    def timing_along(self) -> bool:
        """Whether a speed pass is asked for along with the next trial (`timed_along`)."""
        return self._along is not None

    def plan(self, checkpointed_blocks: int | None) -> tuple[LayerPlan, int | None]:
        """The plan of a step that checkpoints the deep model's first `checkpointed_blocks`
        layers while checkpointing (None: all), and the shallow model's count for it.

        Raises:
            NotReplayable: partial checkpointing needs `PARTIAL_TRACED_LAYERS` traced layers
                and a deep model at least as deep.
        """
        if checkpointed_blocks is None or checkpointed_blocks == self.depth:
            return uniform_plan(self.traced_layers, self.depth), None
        if self.traced_layers != PARTIAL_TRACED_LAYERS:
            raise NotReplayable(f"partial checkpointing from {self.traced_layers} layers")
        return partial_plan(self.traced_layers, self.depth, checkpointed_blocks)

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
        placement: ResidentPlacement | None | _Placed = _Placed.DEVICES,
        from_three: bool = False,
    ) -> StepOutcome:
        """The deep model's trial, replayed (the shallow model is left as the deep one's
        trial would leave it); `checkpointed_blocks` while checkpointing: the deep model's
        first layers checkpointed (None: all). It starts where the device's trials start (its
        warm-up's `placement` of the residents), or from `placement` when given. With
        `from_three`, a step of 2 micro-steps is written out from the shallow step of
        `TRACED_MICRO_STEPS` (its first and last copies), traced for it unless known: the
        caller will ask for the step of 3 or more next, and so traces it once for both.

        Raises:
            NotReplayable: the shallow journal does not show the structure the rule needs.
        """
        plan, shallow_blocks = self.plan(checkpointed_blocks if checkpointing else None)
        start = self.device.placement if placement is _Placed.DEVICES else placement
        # The twin counts no allocator, but its trial counts the BLAS workspaces as the deep
        # model's does: resident once the residents are placed, else at each thread's first
        # matmul (the warm-up's).
        self._twin.placement = start
        runner = self.runner
        step = runner.step
        optimizer = getattr(step.optimizer, "optim", step.optimizer)
        state_was_empty = not optimizer.state
        # More micro-steps than traced: the step of `TRACED_MICRO_STEPS` written out for them;
        # 2 from it too when asked for (its first and last copies: on one rank the last copy
        # is the middle one, which follows the first as a second would).
        written_out = self._microstep_replay and (
            accumulation_steps > TRACED_MICRO_STEPS or (accumulation_steps == 2 and from_three)
        )
        traced_steps = TRACED_MICRO_STEPS if written_out else accumulation_steps
        key = (micro_batch, traced_steps, checkpointing, shallow_blocks)
        shallow = self._journals.get(key)
        if shallow is None:
            shallow = self._journal(micro_batch, traced_steps, checkpointing, shallow_blocks)
            if self._warm and placement is _Placed.DEVICES:
                # After the warm-up a step starts from the same state whatever ran before
                # (the estimate's own answers from earlier traces rest on it), so the same
                # shallow step journals the same events: a DDP rank's too, from the buckets
                # its reducer rebuilt after the warm-up, between the steps.
                self._journals[key] = shallow
        journal = shallow.journal
        if written_out:
            try:
                if shallow.marks is None:
                    raise NotReplayable("the traced step's units are not marked")
                journal = write_out(journal, shallow.marks, accumulation_steps)
            except NotReplayable as reason:
                # The shallow step is traced at its length from now on; the layer replay goes on.
                logger.info("estimate: tracing every micro-step: %s", reason)
                self._microstep_replay = False
                return self.trial(
                    micro_batch,
                    accumulation_steps,
                    checkpointing=checkpointing,
                    checkpointed_blocks=checkpointed_blocks,
                    placement=placement,
                )
        device = self.device
        buckets = (
            None
            if self.buckets is None or shallow.buckets is None
            else JournalBuckets(self.buckets, shallow.buckets)
        )
        if self.zero1 is None:
            deep = expand(journal, plan, buckets)
        else:
            # The rank's optimizer events out, the rest written out, the deep rank's in.
            shallow_share, deep_share = self.zero1
            zero1 = cut(journal, shallow_share)
            deep = splice(expand(zero1.journal, plan, buckets), zero1, deep_share)
        outcome = evaluate(
            deep,
            micro_batch=micro_batch,
            limit_bytes=device.capacity_bytes - device.kept_free_bytes,
            allocator_config=device.allocator_config,
            device_total_bytes=device.info.total_memory_bytes,
            block_bytes=device.block_bytes,
            placement=start,
        )
        if not outcome.fits:
            if self.reducer is not None and outcome.oom_phase is not Phase.OPTIMIZER:
                # The deep model's synchronised backward did not complete: no ready order.
                self.reducer.forget_ready_order()
            # What the deep model's runner does after an out-of-memory (`InProcessRunner._run`),
            # and the optimizer state its step would not have made.
            step.clear_grads()
            if outcome.oom_phase is Phase.OPTIMIZER:
                if runner.has_snapshot:
                    runner.restore()
                else:
                    step.reset_optimizer()
            elif state_was_empty:
                step.reset_optimizer()
        return outcome

    def _journal(
        self,
        micro_batch: int,
        accumulation_steps: int,
        checkpointing: bool,
        shallow_blocks: int | None,
    ) -> _ShallowJournal:
        """The shallow model's journal of one step, traced, with the deep layout of DDP's
        buckets.

        Raises:
            NotReplayable: the shallow step did not complete.
        """
        runner = self.runner
        step = runner.step
        optimizer = getattr(step.optimizer, "optim", step.optimizer)
        # DDP's reducer rebuilds due buckets between steps, as the runner's trial would first
        # (`InProcessRunner._run`): the buckets this step starts with are those.
        step.settle()
        self._tags, self._categories, _ = parameter_tags(self.layers, step.model, optimizer.state)
        resident_buckets = self._bucket_layout()
        if self.reducer is not None and resident_buckets is not None:
            for bucket in self.reducer.buckets:
                key = storage_key(bucket)
                if key is not None:
                    self._categories[key] = BUCKET
        starts: tuple[list[int], ...] = tuple([] for _ in _UNIT_CALLS)
        self._unit_starts = starts
        along = self._along
        if along is not None and along.shallow != (
            micro_batch,
            accumulation_steps,
            checkpointing,
            shallow_blocks,
        ):
            along = None
        ends: SpeedPass | None = None
        fused_before = fused_calls()
        try:
            with contextlib.ExitStack() as timing:
                if along is not None:
                    # The speed pass's modes around the trial's, as around its own step
                    # (`autotune.engine.estimate`), from the same state: the tags of now.
                    tags, _, _ = parameter_tags(self.layers, step.model, optimizer.state)
                    self._timed = LayerKernelTimes(
                        along.budget,
                        along.assumptions,
                        along.tf32,
                        contexts=self.contexts,
                        tags=tags,
                        depth=self.traced_layers,
                        partition=self._partition(),
                    )
                    ends = timing.enter_context(SpeedPass(self._timed, alters=False))
                    timing.enter_context(self._timed)
                shallow = runner.trial(
                    micro_batch,
                    accumulation_steps,
                    checkpointing=checkpointing,
                    checkpointed_blocks=shallow_blocks,
                )
        finally:
            self._unit_starts = None
            timed, self._timed = self._timed, None
        if along is not None and ends is not None and shallow.fits:
            # The speed pass takes dropout out of attention and times the CPU's kernel where
            # the trial's emulates a GPU's fused one: a step that did either is not its step.
            if (
                ends.micro_steps == accumulation_steps
                and not ends.altered
                and fused_calls() == fused_before
            ):
                along.times = timed
        tracker = self._tracker
        self._tracker = None
        self._gradients = None
        if not shallow.fits or tracker is None:
            raise NotReplayable("the traced model's step did not complete")
        journal = tracker.journal
        # Optimizer state made inside this step (the first step's) is optimizer state from
        # its allocation on, as the device's out-of-memory detail counts it.
        for values in optimizer.state.values():
            for value in values.values():
                key = storage_key(value) if isinstance(value, torch.Tensor) else None
                ref = tracker._storages.get(key) if key is not None else None
                if ref is not None and ref.event >= 0:
                    index = tracker._journal_index[ref.event]
                    record = journal[index]
                    journal[index] = (*record[:5], OPTIMIZER_STATE)
        marks = StepMarks(tuple(tuple(unit) for unit in starts))
        return _ShallowJournal(journal, resident_buckets, marks)

    def warm_up(
        self,
        *,
        checkpointing: bool,
        placement: ResidentPlacement | None | _Placed = _Placed.DEVICES,
    ) -> StepOutcome:
        """The deep model's warm-up, from where `trial` starts; the device keeps where it
        left the residents, if it is the first."""
        self._warm = False
        self._journals.clear()
        outcome = self.trial(1, 1, checkpointing=checkpointing, placement=placement)
        if outcome.fits:
            self.runner.settle()
            self.device.keep_placement(outcome)
            self._warm = True
        return outcome


_UNBOUNDED_BYTES = 1 << 62
# The workload's calls a step makes once per micro-step, in the step's order: each starts a
# unit of the step (`autotune.engine.replay.microstep_replay`).
_UNIT_CALLS = ("make_batch", "num_items", "loss_sum")
# A shallow step: micro-batch, accumulation steps, checkpointing, checkpointed shallow layers.
_ShallowKey = tuple[int, int, bool, int | None]


@dataclass
class TimedAlong:
    """A speed pass asked for along with a trial (`LayerReplay.timed_along`): for the GPU
    `budget` under `assumptions`, of the shallow step `shallow`; `times` once traced."""

    budget: GpuBudget
    assumptions: RooflineAssumptions
    tf32: bool
    shallow: tuple[int, int, bool, int | None]
    times: LayerKernelTimes | None = None


@dataclass(frozen=True)
class _ShallowJournal:
    """One shallow step's journal, with the deep layout of DDP's buckets it starts with (None:
    no DDP; a step rebuilds none, the reducer rebuilds them between steps)."""

    journal: list[tuple[Any, ...]]
    buckets: BucketLayout | None
    # Where each unit of the step starts (`autotune.engine.replay.microstep_replay`).
    marks: StepMarks | None = None
