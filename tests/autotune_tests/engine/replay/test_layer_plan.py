"""The layer replay's plan (autotune/engine/replay/layer_plan.py) and the rule that writes a deep
journal by it (autotune/engine/replay/layer_replay.py, `expand`): which traced layer each deep
layer
repeats, under partial checkpointing too (a checkpointed and a plain run of middle layers), and
a journal written out by the plan is the deep step's own journal, event for event; a journal of
another shape raises NotReplayable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from autotune.core.schemas import Phase
from autotune.engine.emulation.layer_journal import (
    ALLOC,
    FREE,
    MARK,
    NO_LAYER,
    OP,
    OTHER,
    STICKY,
    NotReplayable,
)
from autotune.engine.replay.layer_plan import partial_plan, shared_shallow_blocks, uniform_plan
from autotune.engine.replay.layer_replay import PARTIAL_TRACED_LAYERS, TRACED_LAYERS, expand

TRACED = PARTIAL_TRACED_LAYERS


def test_the_uniform_plan_repeats_the_pure_middle_layer() -> None:
    plan = uniform_plan(TRACED_LAYERS, 9)
    assert plan.templates == (0, 1, 2, 2, 2, 2, 2, 3, 4)
    assert plan.repeated == ((1, 2, 3),)
    assert plan.spans == ((0, 4),)


@pytest.mark.parametrize(
    ("depth", "checkpointed", "templates", "traced_checkpointed"),
    [
        # Both runs longer than three: each traced at three, each repeating its second.
        (12, 6, (0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6, 7), 4),
        # A checkpointed run of one or two layers is traced whole, the plain one shortened.
        (12, 2, (0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 6, 7), 2),
        (12, 3, (0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 6, 7), 3),
        # Only the first layer checkpointed: no checkpointed middle layer at all.
        (12, 1, (0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 6, 7), 1),
        # Only the last layer plain, or it and one more.
        (12, 11, (0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 6, 7), 7),
        (12, 10, (0, 1, 2, 2, 2, 2, 2, 2, 2, 5, 6, 7), 6),
        # As deep as the traced model: every layer is its own.
        (8, 4, (0, 1, 2, 3, 4, 5, 6, 7), 4),
    ],
)
def test_a_partial_plan_keeps_each_layers_neighbours(
    depth: int, checkpointed: int, templates: tuple[int, ...], traced_checkpointed: int
) -> None:
    plan, traced = partial_plan(TRACED, depth, checkpointed)
    assert plan.templates == templates
    assert traced == traced_checkpointed


def test_every_partial_plan_maps_each_kind_to_its_kind_and_neighbours_to_neighbours() -> None:
    for depth in range(TRACED, 41):
        for checkpointed in range(1, depth):
            plan, traced = partial_plan(TRACED, depth, checkpointed)
            assert plan.traced_layers == TRACED and plan.depth == depth
            # The checkpointed layers repeat checkpointed traced layers, the plain ones plain.
            assert all(
                (layer < checkpointed) == (template < traced)
                for layer, template in enumerate(plan.templates)
            )
            assert plan.templates[0] == 0 and plan.templates[-1] == TRACED - 1
            # Each layer's neighbours repeat its template's neighbours (or a layer of the same
            # repeated run), so its events name what its template's did.
            for layer, template in enumerate(plan.templates):
                for step in (-1, 1):
                    assert plan.repeats(layer + step, template + step) == (
                        0 <= layer + step < depth
                    )
            assert (0, traced - 1) in plan.spans and (traced, TRACED - 1) in plan.spans
            assert sum(plan.weights()) == depth


def test_every_count_but_the_three_at_each_end_shares_one_shallow_step() -> None:
    # Of a 32-layer model's counts, 4 to 28 (both runs at least as long as a run traced whole)
    # share one shallow step; 1 to 3 and 29 to 31 have their own.
    shared = shared_shallow_blocks(PARTIAL_TRACED_LAYERS)
    sharing = [
        blocks
        for blocks in range(1, 32)
        if partial_plan(PARTIAL_TRACED_LAYERS, 32, blocks)[1] == shared
    ]
    assert sharing == list(range(4, 29))
    others = {partial_plan(PARTIAL_TRACED_LAYERS, 32, b)[1] for b in (1, 2, 3, 29, 30, 31)}
    assert len(others) == 6 and shared not in others


def test_no_partial_plan_where_there_is_no_partial_checkpointing_or_too_few_layers() -> None:
    for checkpointed in (0, 12, 13):
        with pytest.raises(NotReplayable):
            partial_plan(TRACED, 12, checkpointed)
    # A model shallower than the traced one is traced whole.
    for checkpointed in range(1, 7):
        with pytest.raises(NotReplayable):
            partial_plan(TRACED, 7, checkpointed)


# ---------------------------------------------------------------------------------------------
# A step's journal as the journaling tracker writes it (engine/emulation/layer_journal.py),
# made up for a decoder of `depth` layers whose first `checkpointed` are checkpointed: the first
# layer reads the embeddings (one more allocation), a plain layer saves an activation and frees
# its input, a checkpointed one keeps its input and drops its weights' cast at the forward's end
# (autocast's cache), recomputes in the backward, and each layer frees the input gradient of the
# layer after it.


def _step(
    depth: int,
    checkpointed: int,
    *,
    nbytes: Callable[[int], int] = lambda layer: 1024,
    casts_dropped: int | None = None,
    far: bool = False,
) -> list[tuple[Any, ...]]:
    journal: list[tuple[Any, ...]] = []
    forward, backward = Phase.FORWARD, Phase.BACKWARD

    def alloc(size: int, layer: int, phase: Phase) -> int:
        journal.append((ALLOC, size, layer, STICKY, phase, OTHER))
        return len(journal) - 1

    def op(layer: int, phase: Phase, name: str) -> None:
        journal.append((OP, layer, STICKY, phase, True, name))

    def free(event: int, context: int = NO_LAYER) -> None:
        journal.append((FREE, event, context))

    op(NO_LAYER, forward, "embedding")
    outputs, activations, casts, gradients = {}, {}, {}, {}
    for layer in range(depth):
        if layer == 0:
            alloc(64, layer, forward)
        if layer < checkpointed:
            casts[layer] = alloc(256, layer, forward)
        else:
            activations[layer] = alloc(nbytes(layer), layer, forward)
            op(layer, forward, "mlp")
        outputs[layer] = alloc(512, layer, forward)
        op(layer, forward, "add")
        if layer and layer >= checkpointed:
            # `far`: a plain layer frees its input's input instead of its input.
            if not far:
                free(outputs[layer - 1], layer)
            elif layer >= 2:
                free(outputs[layer - 2], layer)
    op(NO_LAYER, forward, "loss")
    free(outputs[depth - 1])  # after the final norm, outside the layers
    for layer in range(checkpointed if casts_dropped is None else casts_dropped):
        free(casts[layer])  # autocast's cache cleared as the forward ends
    op(NO_LAYER, backward, "loss backward")
    for layer in reversed(range(depth)):
        gradients[layer] = alloc(512, layer, backward)
        op(layer, backward, "mm")
        if layer < checkpointed:
            activation = alloc(nbytes(layer), layer, backward)
            op(layer, backward, "recompute")
            free(activation, layer)
            if layer:
                free(outputs[layer - 1], layer)
        else:
            free(activations[layer], layer)
        if layer + 1 < depth:
            free(gradients[layer + 1], layer)
    free(gradients[0], 0)
    journal.append((MARK, NO_LAYER))  # the optimizer step's record_function
    for layer in range(depth):
        journal.append((OP, NO_LAYER, layer, Phase.OPTIMIZER, True, "adamw"))
    return journal


def _replayed(journal: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """What the replay reads of each record (`autotune.engine.replay.layer_replay.evaluate`): an
    allocation's bytes, phase and category, the event a free or gradient names, an op's phase,
    peak check and name; not the layer each was traced in, which only the rule reads."""
    read = {ALLOC: (1, 4, 5), FREE: (1,), OP: (3, 4, 5), MARK: ()}
    return [(record[0], *(record[i] for i in read[record[0]])) for record in journal]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_uniform_journal_written_out_is_the_deep_steps(checkpointing: bool) -> None:
    plan = uniform_plan(TRACED_LAYERS, 9)
    traced = TRACED_LAYERS if checkpointing else 0
    written = expand(_step(TRACED_LAYERS, traced), plan)
    assert _replayed(written) == _replayed(_step(9, 9 if checkpointing else 0))


@pytest.mark.parametrize("depth", [8, 9, 12, 20])
def test_a_partial_journal_written_out_is_the_deep_steps(depth: int) -> None:
    for checkpointed in range(1, depth):
        plan, traced = partial_plan(TRACED, depth, checkpointed)
        written = expand(_step(TRACED, traced), plan)
        assert _replayed(written) == _replayed(_step(depth, checkpointed))


def test_a_journal_of_another_shape_is_not_replayed() -> None:
    plan, traced = partial_plan(TRACED, 12, 6)
    assert traced == 4
    expand(_step(TRACED, traced), plan)
    # The checkpointed run's pure layer allocates otherwise than its neighbours.
    with pytest.raises(NotReplayable, match="differ"):
        expand(_step(TRACED, traced, nbytes=lambda layer: 2048 if layer == 2 else 1024), plan)
    # A sweep over the checkpointed layers but one: no span of the plan's.
    with pytest.raises(NotReplayable, match="a sweep over layers"):
        expand(_step(TRACED, traced, casts_dropped=traced - 1), plan)
    # Plain layers free the output of the layer two before them: the first plain layer names
    # a checkpointed layer's where the pure one names a plain layer's.
    with pytest.raises(NotReplayable):
        expand(_step(TRACED, traced, far=True), plan)
