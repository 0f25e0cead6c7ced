"""The layer replay's plan: which layer of the traced (shallow) model each layer of the deep
decoder repeats (docs/design.md#the-layer-replay).

A decoder's layers are two ends (the first reads the embeddings, the last feeds the final norm)
and, between them, runs of middle layers of one kind: one run in a plain or a fully checkpointed
step; under partial checkpointing of the first k of N layers, the checkpointed layers 1 .. k-1
then the plain layers k .. N-2. The traced model has the same ends and the same runs in the
same order, each run as long as the deep one or shortened to three layers or more. A shortened
run is *repeated*: the deep run takes the traced run's first layer (next to an end or a layer of
the other kind), its second, the *pure* one (between two of its kind), once for each layer
between, and its last layer; a run traced at its full length is the deep run itself. So every
deep layer repeats a traced layer whose neighbours are of the same kinds as its own.

`LayerPlan` is that mapping; `autotune.engine.replay.layer_replay.expand` writes the deep
journal by
it and `autotune.engine.replay.layer_speed` weighs each traced layer's kernels by it. Both
check the
traced step against it first: a repeated run's layers must be one layer (the same events, each
naming its neighbours alike), and an event of the deep step may name a layer only where that
layer repeats the traced layer the template named, or one identical to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.engine.emulation.layer_journal import NotReplayable

# A repeated run needs a first layer, a pure one and a last one.
_SHORTEST_REPEATED = 3


@dataclass(frozen=True)
class LayerPlan:
    """`templates[L]`: the traced layer whose run deep layer L repeats; `repeated`: the traced
    model's repeated runs (module docstring), each the traced layers of one run in order;
    `spans`: the ranges of traced layers, first and last, that a sweep may cover: all of them,
    or those before or after the border of two runs (under partial checkpointing, autocast's
    cache drops the casts of the checkpointed layers' weights as the forward ends, and only
    theirs: a plain layer's are saved for its backward)."""

    traced_layers: int
    templates: tuple[int, ...]
    repeated: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def depth(self) -> int:
        """The deep model's layers."""
        return len(self.templates)

    @staticmethod
    def pure(run: tuple[int, ...]) -> int:
        """A repeated run's pure layer: its second, between two layers of its run."""
        return run[1]

    def run_of(self, layer: int) -> tuple[int, ...] | None:
        """The repeated run traced `layer` belongs to (None: an end, or a run traced whole)."""
        return next((run for run in self.repeated if layer in run), None)

    def deep_layers(self, traced: range) -> range:
        """The deep layers that repeat the traced layers of a span (`traced`), in order."""
        chosen = [layer for layer, t in enumerate(self.templates) if t in traced]
        return range(chosen[0], chosen[-1] + 1)

    def weights(self) -> list[int]:
        """How many deep layers repeat each traced layer."""
        counts = [0] * self.traced_layers
        for template in self.templates:
            counts[template] += 1
        return counts

    def repeats(self, deep_layer: int, traced_layer: int) -> bool:
        """Whether `deep_layer` (any int) is a layer of the deep model that repeats
        `traced_layer`, or a layer of the same repeated run (checked to be one layer)."""
        if not 0 <= deep_layer < len(self.templates):
            return False
        template = self.templates[deep_layer]
        if template == traced_layer:
            return True
        run = self.run_of(template)
        return run is not None and traced_layer in run


def runs_plan(traced_runs: Sequence[int], deep_runs: Sequence[int]) -> LayerPlan:
    """The plan of a traced model of two ends around runs of `traced_runs` middle layers, for a
    deep model whose runs, in the same order, have `deep_runs` layers.

    Raises:
        NotReplayable: a deep run shorter than its traced one, or a shortened one traced at
            fewer than three layers (it would have no pure layer).
    """
    templates = [0]
    repeated: list[tuple[int, ...]] = []
    borders: list[int] = []  # the first traced layer of each run but the first
    first = 1
    for number, (traced, deep) in enumerate(zip(traced_runs, deep_runs, strict=True)):
        if number:
            borders.append(first)
        run = tuple(range(first, first + traced))
        if traced == deep:
            templates += run
        elif _SHORTEST_REPEATED <= traced < deep:
            templates += [run[0], *[LayerPlan.pure(run)] * (deep - 2), run[-1]]
            repeated.append(run)
        else:
            raise NotReplayable(f"a run of {deep} layers from {traced} traced")
        first += traced
    templates.append(first)
    last = first
    spans = ((0, last), *((0, border - 1) for border in borders), *((b, last) for b in borders))
    return LayerPlan(first + 1, tuple(templates), tuple(repeated), spans)


def uniform_plan(traced_layers: int, depth: int) -> LayerPlan:
    """All layers of one kind (a plain or a fully checkpointed step): one run."""
    return runs_plan((traced_layers - 2,), (depth - 2,))


def partial_plan(traced_layers: int, depth: int, checkpointed: int) -> tuple[LayerPlan, int]:
    """The first `checkpointed` of `depth` layers checkpointed: the plan and how many of the
    traced model's first layers to checkpoint. The deep runs are layers 1 .. k-1 (checkpointed;
    layer 0 is an end) and k .. N-2 (plain); a run of at most (traced middle layers - 3) is
    traced whole, the other one shortened to the remaining layers (three or more); with both
    runs longer, each is traced at half of the traced model's middle layers.

    Raises:
        NotReplayable: `checkpointed` not in [1, depth - 1] (no partial checkpointing), or a
            deep model too shallow for the traced one.
    """
    if not 1 <= checkpointed < depth:
        raise NotReplayable(f"{checkpointed} of {depth} layers checkpointed")
    middle = traced_layers - 2
    deep = (checkpointed - 1, depth - checkpointed - 1)
    if deep[0] <= middle - _SHORTEST_REPEATED:
        traced = (deep[0], middle - deep[0])
    elif deep[1] <= middle - _SHORTEST_REPEATED:
        traced = (middle - deep[1], deep[1])
    else:
        traced = _shared_runs(middle)
    return runs_plan(traced, deep), 1 + traced[0]


def _shared_runs(middle: int) -> tuple[int, int]:
    """The traced runs (checkpointed, plain) of every count whose two deep runs are both longer
    than a run traced whole: half of the traced model's `middle` layers each."""
    return (middle // 2, middle - middle // 2)


def shared_shallow_blocks(traced_layers: int) -> int:
    """The traced model's checkpointed layers of the shallow step most counts share: the one
    of every count whose two deep runs are both longer than a run traced whole
    (`partial_plan`); a count near either end has a shallow step of its own."""
    return 1 + _shared_runs(traced_layers - 2)[0]


__all__ = ["LayerPlan", "partial_plan", "runs_plan", "shared_shallow_blocks", "uniform_plan"]
