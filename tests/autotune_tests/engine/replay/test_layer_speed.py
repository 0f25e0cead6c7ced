"""The layer replay's speed pass (autotune/engine/replay/layer_speed.py): a deep decoder's roofline
step time from a five-layer model's kernels (an eight-layer one's under partial checkpointing)
equals the whole model's speed pass to rounding (a sum in another order: 1e-12 relative), the
optimizer's foreach kernels, which span every layer, included; and a measurement that times its
trial's traced step (one trace for both) finds the peaks and times of the two traced apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import Spec
from autotune.engine.estimate import EstimateRunner
from tests.autotune_tests.engine.replay.test_layer_replay import _config, _spec, _the_same

# The fixture counting the traced steps' micro-steps.
from tests.autotune_tests.engine.replay.test_microstep_replay import traced_micro_steps  # noqa: F401

pytest.importorskip("transformers")

A100 = budget_for(find_gpu("A100 80GB"))
RELATIVE = 1e-12


def _runners(
    model_type: str, depth: int, *, lora: bool, optimizer: str
) -> tuple[EstimateRunner, EstimateRunner]:
    spec = _spec(_config(model_type, depth), lora=lora, optimizer=optimizer)
    replayed = EstimateRunner(spec, gpu=A100)
    whole = EstimateRunner(spec, gpu=A100, layer_replay=False)
    assert replayed.layer_replay and not whole.layer_replay
    return replayed, whole


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "lora", "optimizer"),
    [
        ("llama", 8, True, "adamw"),
        ("qwen2", 9, False, "adamw"),
        ("llama", 7, False, "sgd"),
    ],
)
def test_every_replayed_speed_pass_is_the_whole_models(
    model_type: str, depth: int, lora: bool, optimizer: str
) -> None:
    replayed, whole = _runners(model_type, depth, lora=lora, optimizer=optimizer)
    for checkpointing in (False, True):
        assert replayed.warm_up(checkpointing=checkpointing).fits
        assert whole.warm_up(checkpointing=checkpointing).fits
        # One micro-step, two (no middle one) and seven (three traced, the middle one's time
        # written out four more times).
        for micro_batch, accumulation in ((1, 1), (2, 2), (3, 7)):
            assert replayed.step_time_s(
                micro_batch, accumulation, checkpointing=checkpointing
            ) == pytest.approx(
                whole.step_time_s(micro_batch, accumulation, checkpointing=checkpointing),
                rel=RELATIVE,
            )
    assert replayed.speed_replay  # every pass was replayed, none timed whole


@pytest.mark.e2e
def test_a_cold_speed_pass_is_the_whole_models_and_so_are_the_trials_after_it() -> None:
    # Before any warm-up the step makes the optimizer's state (AdamW's step counters come
    # from no parameter's tensor: they go with the layer before them).
    replayed, whole = _runners("llama", 7, lora=True, optimizer="adamw")
    assert replayed.step_time_s(2, 3) == pytest.approx(whole.step_time_s(2, 3), rel=RELATIVE)
    assert replayed.speed_replay
    # The shallow model keeps the state its speed pass made, as the whole model does.
    assert replayed.warm_up() == whole.warm_up()
    assert replayed.trial(2) == whole.trial(2)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "lora", "optimizer", "blocks"),
    [
        ("llama", 10, True, "adamw", (1, 9)),
        ("qwen2", 9, False, "adamw", (4,)),
        # 5 and 6 of 12 blocks: one shallow step, timed once, written out by two plans.
        ("llama", 12, False, "sgd", (5, 6)),
    ],
)
def test_every_partial_checkpointing_speed_pass_replayed_is_the_whole_models(
    model_type: str, depth: int, lora: bool, optimizer: str, blocks: tuple[int, ...]
) -> None:
    replayed, whole = _runners(model_type, depth, lora=lora, optimizer=optimizer)
    for checkpointing in (False, True):
        assert replayed.warm_up(checkpointing=checkpointing).fits
        assert whole.warm_up(checkpointing=checkpointing).fits
        every_partial_speed_pass_the_same(replayed, whole, blocks, [(1, 1), (2, 2), (3, 7)])


def every_partial_speed_pass_the_same(
    replayed: EstimateRunner,
    whole: EstimateRunner,
    blocks: Sequence[int],
    steps: Sequence[tuple[int, int]],
) -> None:
    """Each (micro-batch, accumulation) of `steps` at each count of checkpointed `blocks`,
    replayed and timed whole, is the same (1e-12 relative); every pass was replayed, from the
    eight-layer model, none timed whole."""
    for count in blocks:
        for micro_batch, accumulation in steps:
            assert replayed.step_time_s(
                micro_batch, accumulation, checkpointing=True, checkpointed_blocks=count
            ) == pytest.approx(
                whole.step_time_s(
                    micro_batch, accumulation, checkpointing=True, checkpointed_blocks=count
                ),
                rel=RELATIVE,
            )
    assert replayed.partial_speed_replay and replayed.speed_replay


# (micro-batch, accumulation): one micro-step, two, and more written out from three.
MEASURED = ((1, 1), (2, 2), (3, 7))


@pytest.mark.e2e
# One model (4 minutes for a LoRA Llama of 10 layers as well): a LoRA AdamW step's measurement
# is timed as it is traced in the fewest-blocks test and the attention test below.
@pytest.mark.parametrize(
    ("model_type", "depth", "lora", "optimizer"), [("qwen2", 9, False, "sgd")]
)
def test_a_measurement_times_the_step_its_trial_traces(
    model_type: str,
    depth: int,
    lora: bool,
    optimizer: str,
    traced_micro_steps: list[int],  # noqa: F811
) -> None:
    # One runner measures (its trial's shallow step timed as it is traced), the other traces
    # the trial and the speed pass apart: the same peaks to the byte, the same times. Partial
    # checkpointing first: its model is built right after the first warm-up.
    spec = _spec(_config(model_type, depth), lora=lora, optimizer=optimizer)
    along = EstimateRunner(spec, gpu=A100)
    apart = EstimateRunner(spec, gpu=A100)
    for checkpointing, blocks in ((True, 4), (False, None), (True, None)):
        assert along.warm_up(checkpointing=checkpointing) == apart.warm_up(
            checkpointing=checkpointing
        )
        for micro_batch, accumulation in MEASURED:
            settings: dict[str, Any] = {
                "checkpointing": checkpointing,
                "checkpointed_blocks": blocks,
            }
            traced_micro_steps.clear()
            measured = along.measure(micro_batch, accumulation, target_seconds=1.0, **settings)
            # One traced step for both (the partial model's first trial builds it and warms
            # it up first).
            warming = [1] if blocks is not None and (micro_batch, accumulation) == (1, 1) else []
            assert traced_micro_steps == [*warming, min(accumulation, 3)]
            trial = apart.trial(micro_batch, accumulation, **settings)
            _the_same(along.trial(micro_batch, accumulation, **settings), trial)
            assert measured is not None and measured.peak_bytes == trial.peak_bytes
            assert measured.step_time_s == pytest.approx(
                apart.step_time_s(micro_batch, accumulation, **settings), rel=RELATIVE
            )
        # (A warm-up after the partial model's may find its warm-up differs: it stops.)
        assert along.speed_replay and (blocks is None or along.partial_speed_replay)


def _warm_runners(spec: Spec) -> tuple[EstimateRunner, EstimateRunner, EstimateRunner]:
    """Two runners of `spec` with the layer replay and one tracing the whole model, warm."""
    runners = (
        EstimateRunner(spec, gpu=A100),
        EstimateRunner(spec, gpu=A100),
        EstimateRunner(spec, gpu=A100, layer_replay=False),
    )
    for runner in runners:
        assert runner.warm_up().fits
    return runners


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("sharding", "traced_at_most"), [("none", 5), ("zero1", 5), ("zero2", 3), ("zero3", 3)]
)
def test_a_rank_of_several_times_the_step_its_trial_traces(
    sharding: str,
    traced_at_most: int,
    traced_micro_steps: list[int],  # noqa: F811
) -> None:
    # A DDP rank traces its trial's step at its length, up to 5 micro-steps (its last
    # synchronises the gradients), an FSDP2 rank up to 3 (written out for more), and the
    # speed pass traces as many, so a measurement traces one step for both. Its compute time
    # is the one another runner's speed pass traced apart finds, to the bit, and the whole
    # model's speed pass of 3 micro-steps to rounding. Full fine-tuning with AdamW: a ZeRO-1
    # rank's optimizer kernels run over its partition.
    spec = _spec(
        _config("llama", 8), lora=False, optimizer="adamw", world_size=2, sharding=sharding
    )
    along, apart, whole = _warm_runners(spec)
    settings: dict[str, Any] = {"checkpointing": False}
    for micro_batch, accumulation in ((2, 2), (1, 7)):
        traced_micro_steps.clear()
        measured = along.measure(micro_batch, accumulation, target_seconds=1.0, **settings)
        assert traced_micro_steps == [min(accumulation, traced_at_most)]
        trial = apart.trial(micro_batch, accumulation, **settings)
        _the_same(along.trial(micro_batch, accumulation, **settings), trial)
        assert measured is not None and measured.peak_bytes == trial.peak_bytes
        traced_micro_steps.clear()
        compute_s = apart.step_time_s(micro_batch, accumulation, **settings)
        assert traced_micro_steps == [min(accumulation, traced_at_most)]
        assert measured.compute_time_s == compute_s
        assert compute_s == pytest.approx(
            whole.step_time_s(micro_batch, accumulation, **settings), rel=RELATIVE
        )
    assert along.speed_replay and apart.speed_replay


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("lora", "ranks"),
    [(True, {}), (False, {}), (True, {"world_size": 2, "sharding": "zero3"})],
)
def test_the_fewest_blocks_search_traces_the_step_its_measurement_then_answers(
    lora: bool,
    ranks: dict[str, Any],
    traced_micro_steps: list[int],  # noqa: F811
) -> None:
    # The tuner's fewest-blocks search (trials of 2 micro-steps at several counts), then the
    # count it found measured at 16 micro-steps: the search traces the shallow step of 3 once,
    # its speed pass along, and the measurement traces nothing. Another runner measures
    # alone (its trial's step timed as it is traced): the same peak and time to the bit; the
    # search's trials are the whole model's traced at 2 micro-steps. On one rank and on an
    # FSDP2 rank of two.
    spec = _spec(_config("llama", 12), lora=lora, optimizer="adamw", **ranks)
    searched, alone, whole = _warm_runners(spec)
    settings: dict[str, Any] = {"checkpointing": True}
    # Counts 6 and 7 share a shallow step (4 of 8 layers checkpointed), traced at 3 for the
    # measurement ahead; 9 has its own, and traces its 2. The first trial builds the partial
    # model and warms it up.
    for blocks, traced in ((6, [1, 3]), (9, [2]), (7, [])):
        traced_micro_steps.clear()
        trial = searched.trial(4, 2, checkpointed_blocks=blocks, **settings)
        assert traced_micro_steps == traced
        _the_same(trial, whole.trial(4, 2, checkpointed_blocks=blocks, **settings))
    traced_micro_steps.clear()
    measured = searched.measure(4, 16, target_seconds=1.0, checkpointed_blocks=7, **settings)
    assert traced_micro_steps == []
    expected = alone.measure(4, 16, target_seconds=1.0, checkpointed_blocks=7, **settings)
    assert measured is not None and measured == expected
    assert searched.partial_speed_replay


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [{"num_key_value_heads": 4}, {"attention_dropout": 0.1}])
def test_a_step_whose_attention_the_speed_pass_changes_is_timed_apart(
    extra: dict[str, Any],
    traced_micro_steps: list[int],  # noqa: F811
) -> None:
    # Without grouped-query attention the trial runs the GPU's fused kernel's emulation (its
    # kernels out of sight), with dropout the speed pass leaves dropout out: its own trace.
    spec = _spec(_config("llama", 7, **extra), lora=True, optimizer="adamw")
    along = EstimateRunner(spec, gpu=A100)
    apart = EstimateRunner(spec, gpu=A100)
    assert along.warm_up() == apart.warm_up()
    traced_micro_steps.clear()
    measured = along.measure(2, 5, checkpointing=False, target_seconds=1.0)
    assert traced_micro_steps == [3, 3]
    trial = apart.trial(2, 5, checkpointing=False)
    assert measured is not None and measured.peak_bytes == trial.peak_bytes
    assert measured.step_time_s == pytest.approx(
        apart.step_time_s(2, 5, checkpointing=False), rel=RELATIVE
    )
