"""The layer replay of a sharded rank (autotune/engine/replay/layer_replay.py): FSDP2's zero2,
zero3 and
hybrid ranks on fake process groups, where every decoder layer is its own unit, replayed from a
five-layer model's journal are the deep model's own traced trials to the byte (peaks, phase
peaks, out-of-memory and its detail, per-op live bytes, allocation trace), and its speed passes
and communication are the whole model's."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import Phase, Spec
from autotune.engine.estimate import EstimateRunner
from autotune.engine.replay.layer_replay import replay_depth
from tests.autotune_tests.engine.replay.test_layer_replay import (
    MiB,
    _config,
    _spec,
    _the_same,
    every_partial_trial_the_same,
    every_trial_the_same,
)

pytest.importorskip("transformers")

A100 = budget_for(find_gpu("A100 80GB"))
RELATIVE = 1e-12


def _sharded(
    model_type: str,
    depth: int,
    sharding: str,
    ranks: int,
    *,
    lora: bool,
    config: dict[str, Any] | None = None,
    **training: Any,
) -> Spec:
    if sharding == "hybrid":
        training["shard_group_size"] = 2
    return _spec(
        _config(model_type, depth, **(config or {})),
        lora=lora,
        world_size=ranks,
        sharding=sharding,
        **training,
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "sharding", "ranks", "lora", "capacity_bytes"),
    # Each layout once, on 2, 4 and 8 ranks (LoRA on zero3 and hybrid ranks: the partial and
    # out-of-memory tests below).
    [
        ("llama", 8, "zero2", 2, True, 20 * MiB),
        ("qwen2", 9, "zero3", 4, False, 32 * MiB),
        ("llama", 12, "hybrid", 8, False, 48 * MiB),
    ],
)
def test_every_replayed_sharded_trial_is_the_whole_trace_to_the_byte(
    model_type: str, depth: int, sharding: str, ranks: int, lora: bool, capacity_bytes: int
) -> None:
    spec = _sharded(model_type, depth, sharding, ranks, lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    assert replayed.layer_replay and not traced.layer_replay
    every_trial_the_same(replayed, traced)
    assert replayed._full is None  # every trial replayed, those that ran out included


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "sharding", "ranks", "lora"),
    [
        ("llama", 8, "zero3", 4, True),
        ("qwen2", 9, "hybrid", 8, False),
        ("llama", 7, "zero2", 2, False),
    ],
)
def test_every_replayed_sharded_speed_pass_and_communication_is_the_whole_models(
    model_type: str, depth: int, sharding: str, ranks: int, lora: bool
) -> None:
    every_speed_pass_and_communication_the_same(
        _sharded(model_type, depth, sharding, ranks, lora=lora)
    )


def every_speed_pass_and_communication_the_same(spec: Spec) -> None:
    """Speed passes of both checkpointing modes and 1, 2 and 7 micro-steps, replayed and timed
    whole, are the same (1e-12 relative), and so is the communication beside them; the replay
    builds no whole model."""
    replayed = EstimateRunner(spec, gpu=A100)
    whole = EstimateRunner(spec, gpu=A100, layer_replay=False)
    for checkpointing in (False, True):
        assert replayed.warm_up(checkpointing=checkpointing).fits
        assert whole.warm_up(checkpointing=checkpointing).fits
        for micro_batch, accumulation in ((1, 1), (2, 2), (3, 7)):
            compute_s = whole.step_time_s(micro_batch, accumulation, checkpointing=checkpointing)
            assert replayed.step_time_s(
                micro_batch, accumulation, checkpointing=checkpointing
            ) == pytest.approx(compute_s, rel=RELATIVE)
            assert replayed.communication(compute_s, accumulation) == whole.communication(
                compute_s, accumulation
            )
    assert replayed.speed_replay  # every pass was replayed, none timed whole
    assert replayed._full is None  # nor was the whole model built for the communication


def test_fsdp2_ranks_are_replayed() -> None:
    # DDP's and ZeRO-1's: tests/autotune_tests/engine/replay/test_layer_replay_ddp.py.
    for sharding in ("zero2", "zero3", "hybrid"):
        assert replay_depth(_sharded("llama", 16, sharding, 4, lora=True)) == 16


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("sharding", "ranks", "lora", "capacity_bytes", "blocks"),
    [("zero3", 4, True, 24 * MiB, (1, 6, 9)), ("hybrid", 4, False, 40 * MiB, (2, 8))],
)
def test_partial_checkpointing_of_a_sharded_rank_replayed_is_the_whole_trace_to_the_byte(
    sharding: str, ranks: int, lora: bool, capacity_bytes: int, blocks: tuple[int, ...]
) -> None:
    """The two replays together: an FSDP2 rank whose first k layers are checkpointed, written
    out from the 8-layer model's journal, is the deep rank's own trace."""
    spec = _sharded("llama", 10, sharding, ranks, lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    _the_same(replayed.warm_up(checkpointing=True), traced.warm_up(checkpointing=True))
    every_partial_trial_the_same(replayed, traced, blocks, [(1, 1), (2, 2), (32, 1)])


# Layers wide enough beside the 512-token vocabulary that a step runs out inside a layer, while
# FSDP2 has swapped its shards for its gathered parameters (and, in the backward, while those
# hold their gradients): what an out-of-memory's detail counts as weights and gradients then is
# what the journal's holds and drops say.
WIDE = {"hidden_size": 256, "intermediate_size": 1024}


# (model type, depth, sharding, ranks, LoRA, sequence length, capacity in MiB, checkpointed
# warm-up), its trials (micro-batch, accumulation, checkpointing, checkpointed blocks) and the
# phases they run out in (None: fits), each capacity chosen for them.
RUNS_OUT = [
    # In a layer's forward and, checkpointed, in a layer's backward with some of its gathered
    # parameters' gradients accumulated.
    (
        ("qwen2", 9, "zero3", 4, False, 128, 60, False),
        [(1, 1, False, None), (2, 2, False, None), (4, 1, True, None), (2, 1, True, None)],
        {None, Phase.FORWARD, Phase.BACKWARD},
    ),
    # The warm-up in the optimizer (its first step makes the AdamW state), then cold trials.
    (
        ("llama", 8, "zero2", 2, False, 16, 76, False),
        [(1, 1, True, None), (2, 1, False, None), (1, 2, True, None)],
        {Phase.OPTIMIZER},
    ),
    (
        ("llama", 12, "hybrid", 8, True, 128, 60, False),
        [(1, 1, False, None), (2, 1, True, None), (4, 1, False, None), (8, 1, True, None)],
        {None, Phase.FORWARD},
    ),
    (
        ("qwen2", 7, "zero2", 4, True, 128, 50, True),
        [(1, 1, True, None), (8, 1, True, None), (4, 1, True, None), (2, 1, False, None)],
        {None, Phase.FORWARD, Phase.BACKWARD},
    ),
    # Partial checkpointing (the 8-layer journal): in a checkpointed layer's recomputation and
    # backward, and in the forward, at 2, 5 and 8 of 10 blocks.
    (
        ("llama", 10, "zero3", 4, False, 128, 70, True),
        [(2, 1, True, 8), (2, 1, True, 2), (4, 1, True, 8), (2, 2, True, 5)],
        {None, Phase.FORWARD, Phase.BACKWARD},
    ),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("rank", "trials", "phases"),
    RUNS_OUT,
    ids=[
        "-".join(str(part) for part in (*rank[:4], "lora" if rank[4] else "full", *rank[5:7]))
        for rank, *_ in RUNS_OUT
    ],
)
def test_a_sharded_rank_that_runs_out_is_replayed_with_its_detail_to_the_byte(
    rank: tuple[str, int, str, int, bool, int, int, bool],
    trials: list[tuple[int, int, bool, int | None]],
    phases: set[Phase | None],
) -> None:
    """Out-of-memory inside a layer's forward and backward and in the optimizer, on zero2,
    zero3 and hybrid ranks: the replayed detail (weights and gradients registered on the model
    then, optimizer state, activations, cache) and every other field are the whole trace's."""
    model_type, depth, sharding, ranks, lora, seq_len, capacity_mib, warm_checkpointing = rank
    spec = _sharded(model_type, depth, sharding, ranks, lora=lora, config=WIDE, seq_len=seq_len)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_mib * MiB)
    traced = EstimateRunner(spec, capacity_bytes=capacity_mib * MiB, layer_replay=False)
    warm = replayed.warm_up(checkpointing=warm_checkpointing)
    _the_same(warm, traced.warm_up(checkpointing=warm_checkpointing))
    seen = {warm.oom_phase}
    for micro_batch, accumulation, checkpointing, blocks in trials:
        outcomes = [
            runner.trial(
                micro_batch, accumulation, checkpointing=checkpointing, checkpointed_blocks=blocks
            )
            for runner in (replayed, traced)
        ]
        _the_same(*outcomes)
        seen.add(outcomes[0].oom_phase)
    assert seen == phases
    # Every trial replayed (partial checkpointing's by its own traced model), none traced whole.
    assert replayed.layer_replay and replayed._full is None
    assert replayed.partial_replay == any(blocks is not None for *_, blocks in trials)


@pytest.mark.e2e
def test_partial_checkpointing_after_a_plain_warm_up_that_ran_out_is_replayed() -> None:
    """A zero3 rank whose plain warm-up runs out and whose checkpointed one fits (the 70B LoRA
    rank's sequence): partial checkpointing's 8-layer model runs both warm-ups as the replay
    did, so its trials are replayed, and each is the whole trace's to the byte. From its
    checkpointed warm-up alone, its model's first step (FSDP2's lazy initialisation in it) was
    not the replay's second one, and every partial trial was traced whole."""
    spec = _sharded("llama", 10, "zero3", 4, lora=True)
    replayed = EstimateRunner(spec, capacity_bytes=5 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=5 * MiB, layer_replay=False)
    for checkpointing, fits in ((False, False), (True, True)):
        warm = replayed.warm_up(checkpointing=checkpointing)
        _the_same(warm, traced.warm_up(checkpointing=checkpointing))
        assert warm.fits is fits
    every_partial_trial_the_same(replayed, traced, (2, 8), [(1, 1), (2, 2)])
