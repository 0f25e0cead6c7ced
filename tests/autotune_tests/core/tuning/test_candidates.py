"""Candidate enumeration and the infeasibility explanation, checked against brute force."""

from __future__ import annotations

import itertools

import pytest

from autotune.core.schemas import AllocatorOption, ModeProbe
from autotune.core.tuning.candidates import (
    Candidate,
    enumerate_candidates,
    explain_infeasible,
    probe_candidates,
)


def _brute_force(target: int, world: int, limits: dict[bool, int]) -> set[Candidate]:
    return {
        Candidate(b, g, ckpt)
        for ckpt, limit in limits.items()
        for b in range(1, limit + 1)
        for g in range(1, target + 1)
        if b * g * world == target
    }


def _achievable(world: int, limit: int, upto: int) -> set[int]:
    return {world * b * g for b in range(1, limit + 1) for g in range(1, upto + 1)}


def test_enumerates_every_divisor_per_mode_in_order() -> None:
    candidates = enumerate_candidates(12, 1, {True: 12, False: 4})
    assert candidates == [
        Candidate(1, 12, False),
        Candidate(2, 6, False),
        Candidate(3, 4, False),
        Candidate(4, 3, False),
        Candidate(1, 12, True),
        Candidate(2, 6, True),
        Candidate(3, 4, True),
        Candidate(4, 3, True),
        Candidate(6, 2, True),
        Candidate(12, 1, True),
    ]


def test_world_size_divides_the_target_first() -> None:
    candidates = enumerate_candidates(48, 4, {False: 5})
    assert [(c.micro_batch, c.accumulation_steps) for c in candidates] == [
        (1, 12),
        (2, 6),
        (3, 4),
        (4, 3),
    ]
    assert all(c.global_batch(4) == 48 for c in candidates)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_brute_force(world: int) -> None:
    for target, limit_off, limit_on in itertools.product(range(1, 41), [0, 1, 3, 7], [0, 5, 64]):
        limits = {False: limit_off, True: limit_on}
        candidates = enumerate_candidates(target, world, limits)
        assert len(candidates) == len(set(candidates))
        assert set(candidates) == _brute_force(target, world, limits), (target, limits)


def test_modes_that_do_not_fit_or_are_missing_give_nothing() -> None:
    assert enumerate_candidates(8, 1, {False: 0, True: 2}) == [
        Candidate(1, 8, True),
        Candidate(2, 4, True),
    ]
    assert enumerate_candidates(8, 1, {False: 3}) == [
        Candidate(1, 8, False),
        Candidate(2, 4, False),
    ]
    assert enumerate_candidates(8, 1, {}) == []


def test_target_not_divisible_by_world_size_has_no_candidates() -> None:
    assert enumerate_candidates(10, 4, {False: 64, True: 64}) == []


@pytest.mark.parametrize(("target", "world"), [(0, 1), (8, 0)])
def test_rejects_nonsense_arguments(target: int, world: int) -> None:
    with pytest.raises(ValueError):
        enumerate_candidates(target, world, {False: 4})
    with pytest.raises(ValueError):
        explain_infeasible(target, world, {False: 4})


def test_explains_indivisible_target_with_nearest_batches() -> None:
    infeasible = explain_infeasible(10, 4, {False: 16, True: 64})
    assert "divisible by world size 4" in infeasible.reason
    assert (infeasible.nearest_below, infeasible.nearest_above) == (8, 12)


def test_nothing_below_when_target_is_smaller_than_world_size() -> None:
    infeasible = explain_infeasible(3, 4, {False: 2})
    assert infeasible.nearest_below is None
    assert infeasible.nearest_above == 4


def test_explains_when_nothing_fits() -> None:
    infeasible = explain_infeasible(32, 1, {False: 0, True: 0})
    assert "not even a micro-batch of 1" in infeasible.reason
    assert infeasible.nearest_below is None
    assert infeasible.nearest_above is None
    assert explain_infeasible(32, 1, {}).nearest_above is None


def test_refuses_to_explain_an_achievable_target() -> None:
    with pytest.raises(ValueError, match="achievable"):
        explain_infeasible(12, 2, {False: 1})


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_nearest_batches_match_brute_force(world: int) -> None:
    for target in range(1, 50):
        if target % world == 0:
            continue
        for limit in (1, 3, 6):
            infeasible = explain_infeasible(target, world, {False: limit, True: 0})
            reachable = _achievable(world, limit, upto=target + 1)
            below = [n for n in reachable if n < target]
            assert infeasible.nearest_below == (max(below) if below else None)
            assert infeasible.nearest_above == min(n for n in reachable if n > target)


# ---------------------------------------------------------------------------------------------
# Candidates under expandable segments (`probe_candidates`).

EXPANDABLE = "expandable_segments:True"


def _mode(
    recommended: int,
    accumulating: int | None = None,
    *,
    dips: tuple[int, ...] = (),
    option: AllocatorOption | None = None,
) -> ModeProbe:
    return ModeProbe(
        checkpointing=False,
        max_micro_batch=recommended,
        recommended_micro_batch=recommended,
        accumulating_micro_batch=accumulating,
        capped=False,
        attempts=[],
        runs_out_below=list(dips),
        expandable_segments=option,
    )


def _verified(
    recommended: int, accumulating: int | None = None, **fields: object
) -> AllocatorOption:
    return AllocatorOption.model_validate(
        {
            "allocator_conf": EXPANDABLE,
            "max_micro_batch": recommended,
            "recommended_micro_batch": recommended,
            "accumulating_micro_batch": accumulating,
            "recommended": True,
            **fields,
        }
    )


def _under(candidates: list[Candidate]) -> dict[int, str | None]:
    return {c.micro_batch: c.allocator_conf for c in candidates}


def test_without_expandable_segments_the_candidates_are_the_enumerated_ones() -> None:
    modes = [_mode(8, 4)]
    assert probe_candidates(24, 1, modes) == [
        c
        for c in enumerate_candidates(24, 1, {False: 8})
        if c.accumulation_steps == 1 or c.micro_batch <= 4
    ]
    # Before the accumulation probe an unset accumulating limit is the recommended one.
    assert _under(probe_candidates(24, 1, [_mode(8)], accumulation_probed=False)) == {
        b: None for b in (1, 2, 3, 4, 6, 8)
    }
    assert _under(probe_candidates(24, 1, [_mode(8)])) == {}


def test_expandable_segments_take_the_sizes_the_default_allocator_stops_short_of() -> None:
    # Default: 8 alone, 4 accumulating; expandable segments: 12 alone, 6 accumulating.
    modes = [_mode(8, 4, option=_verified(12, 6))]
    assert _under(probe_candidates(24, 1, modes)) == {
        1: None,
        2: None,
        3: None,
        4: None,
        6: EXPANDABLE,  # 6 x 4 accumulates: the default allocator holds 4 at most
    }
    # At G = 1 (target 12): 12 fits only under them.
    assert _under(probe_candidates(12, 1, modes))[12] == EXPANDABLE
    # A size the default allocator runs out at below its answer, verified under them.
    dipped = [_mode(8, 8, dips=(6,), option=_verified(12, 12))]
    assert _under(probe_candidates(12, 1, dipped))[6] == EXPANDABLE
    # Their own dips are never candidates under them; the default's stay as they were.
    both = [_mode(8, 8, dips=(6,), option=_verified(12, 12, runs_out_below=[6]))]
    assert _under(probe_candidates(12, 1, both))[6] is None


def test_expandable_segments_only_traced_add_no_candidate() -> None:
    traced = AllocatorOption(allocator_conf=EXPANDABLE, traced_max_micro_batch=12)
    assert _under(probe_candidates(12, 1, [_mode(8, 8, option=traced)])) == {
        b: None for b in (1, 2, 3, 4, 6)
    }
    # Before accumulating limits under them are known, the sizes to probe are their answer's.
    modes = [_mode(8, 4, option=_verified(12))]
    assert _under(probe_candidates(24, 1, modes, accumulation_probed=False))[12] == EXPANDABLE
    assert 12 not in _under(probe_candidates(24, 1, modes))
