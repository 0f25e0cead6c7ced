"""The layer replay of DDP's ranks (autotune/engine/replay/layer_replay.py, layer_buckets.py):
a deep
decoder's gradient buckets laid out from a five-layer model's parameters and ready order are the
deep reducer's own, and its trials replayed from the five-layer journal with those buckets are
the deep model's own traced trials to the byte (peaks, phase peaks, out-of-memory and its
detail, per-op live bytes, allocation trace), its speed passes and communication the whole
model's (ZeRO-1's ranks: test_layer_zero1.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autotune.core.memory.gradient_buckets import BucketTensor
from autotune.core.schemas import Phase, Spec, StepOutcome
from autotune.engine.emulation.layer_journal import NotReplayable
from autotune.engine.estimate import EstimateRunner
from autotune.engine.replay.layer_buckets import LayerBuckets
from autotune.engine.replay.layer_replay import TRACED_LAYERS, replay_depth
from autotune.engine.training.data_parallel import EmulatedReducer, trainable_parameters
from tests.autotune_tests.engine.replay import test_layer_replay as single_rank
from tests.autotune_tests.engine.replay.test_layer_replay_sharded import (
    A100,
    RELATIVE,
    every_speed_pass_and_communication_the_same,
)

MiB = single_rank.MiB


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention = nn.Linear(width, width)
        self.up = nn.Linear(width, 3 * width, bias=False)
        self.down = nn.Linear(3 * width, width, bias=False)
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(torch.relu(self.up(x))) * self.scale.float()


class _Decoder(nn.Module):
    """Parameters outside the layers before and after them, identical layers between."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList([_Layer(width) for _ in range(depth)])
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.embed
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _reducer_after_a_synchronised_step(depth: int, width: int) -> tuple[_Decoder, EmulatedReducer]:
    with torch.device("meta"):
        model = _Decoder(depth, width)
    reducer = EmulatedReducer(model)
    with reducer.micro_batch(first=True, sync=True):
        model(torch.ones(2, width, device="meta")).sum().backward()
    return model, reducer


def _layer_buckets(model: _Decoder, depth: int) -> LayerBuckets:
    layers = {id(p): index for index, layer in enumerate(model.layers) for p in layer.parameters()}
    trainable = trainable_parameters(model)
    return LayerBuckets(
        [BucketTensor(p.numel() * p.element_size(), (p.dtype, p.device)) for p in trainable],
        [layers.get(id(p)) for p in trainable],
        TRACED_LAYERS,
        depth,
    )


def _members(reducer: EmulatedReducer, model: nn.Module) -> list[int]:
    """Each parameter's bucket in `reducer`, by the storage its bucket view shares."""
    buckets = {id(b.untyped_storage()): i for i, b in enumerate(reducer.buckets)}
    views = reducer._views
    return [buckets[id(view.untyped_storage())] for view in views]


@pytest.mark.parametrize(("depth", "width"), [(7, 256), (12, 512), (20, 384), (9, 96)])
def test_the_deep_buckets_are_the_deep_reducers_own(depth: int, width: int) -> None:
    shallow, shallow_reducer = _reducer_after_a_synchronised_step(TRACED_LAYERS, width)
    deep, deep_reducer = _reducer_after_a_synchronised_step(depth, width)
    layout = _layer_buckets(shallow, depth)
    # Made with the model: one bucket per dtype.
    made = layout.construction()
    assert list(made.sizes_bytes) == deep_reducer.bucket_sizes_bytes()
    assert list(made.bucket_of) == _members(deep_reducer, deep)
    # Rebuilt in the order the gradients became ready, 1 MiB then 25 MiB buckets that span
    # layers: from the shallow ready order, the deep reducer's.
    shallow_reducer.rebuild_if_due()
    deep_reducer.rebuild_if_due()
    assert deep_reducer.rebuilt and len(deep_reducer.bucket_sizes_bytes()) >= 2
    rebuilt = layout.rebuilt(shallow_reducer.ready_order)
    assert list(rebuilt.sizes_bytes) == deep_reducer.bucket_sizes_bytes()
    assert list(rebuilt.bucket_of) == _members(deep_reducer, deep)
    if len(deep_reducer.bucket_sizes_bytes()) > 3:
        # Their number follows the depth: no repetition of the shallow model's.
        assert len(shallow_reducer.bucket_sizes_bytes()) < len(deep_reducer.bucket_sizes_bytes())


def test_a_ready_order_that_is_not_layer_by_layer_is_not_replayed() -> None:
    shallow, reducer = _reducer_after_a_synchronised_step(TRACED_LAYERS, 64)
    layout = _layer_buckets(shallow, 9)
    order = list(reducer.ready_order)
    layout.rebuilt(order)
    per_layer = len(list(shallow.layers[0].parameters()))
    first_layer = order.index(1)  # the first layer's first parameter (the embedding is 0)
    swapped = order[:]
    # One parameter of the first layer ready among the second layer's.
    swapped[first_layer], swapped[first_layer - per_layer] = (
        swapped[first_layer - per_layer],
        swapped[first_layer],
    )
    with pytest.raises(NotReplayable):
        layout.rebuilt(swapped)
    with pytest.raises(NotReplayable):
        layout.rebuilt(order[:-1])


def _ddp(
    model_type: str, depth: int, sharding: str, ranks: int, *, lora: bool, **extra: Any
) -> Spec:
    return single_rank._spec(
        single_rank._config(model_type, depth, **extra),
        lora=lora,
        world_size=ranks,
        sharding=sharding,
    )


def test_ddp_ranks_are_replayed() -> None:
    # ZeRO-1's ranks: tests/autotune_tests/engine/replay/test_layer_zero1.py.
    for ranks in (2, 8):
        assert replay_depth(_ddp("llama", 16, "none", ranks, lora=True)) == 16


# Wider layers than the single rank's tests: a layer's gradients of a few MiB, so that the deep
# model's 25 MiB buckets span layers and outnumber the shallow model's.
_WIDE = {"hidden_size": 512, "intermediate_size": 1024}


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "ranks", "lora", "capacity_bytes", "extra"),
    # 2, 4 and 8 ranks, LoRA and full, buckets within and across layers.
    [
        ("llama", 8, 2, True, 20 * MiB, {}),
        ("qwen2", 9, 4, False, 32 * MiB, {}),
        ("qwen2", 12, 8, False, 700 * MiB, _WIDE),
    ],
)
def test_every_replayed_ddp_trial_is_the_whole_trace_to_the_byte(
    model_type: str,
    depth: int,
    ranks: int,
    lora: bool,
    capacity_bytes: int,
    extra: dict[str, int],
) -> None:
    # Out-of-memory trials too: a DDP rank keeps its parameters, so the detail is replayed.
    single_rank.every_trial_of_spec_the_same(
        _ddp(model_type, depth, "none", ranks, lora=lora, **extra), capacity_bytes
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "ranks", "lora", "extra"),
    [("llama", 8, 4, True, {}), ("qwen2", 9, 8, False, _WIDE), ("llama", 7, 2, False, {})],
)
def test_every_replayed_ddp_speed_pass_and_communication_is_the_whole_models(
    model_type: str, depth: int, ranks: int, lora: bool, extra: dict[str, int]
) -> None:
    every_speed_pass_and_communication_the_same(
        _ddp(model_type, depth, "none", ranks, lora=lora, **extra)
    )


@pytest.mark.e2e
def test_a_speed_pass_before_the_warm_up_then_trials_that_rebuild_the_buckets() -> None:
    """A synchronised step that is no warm-up records the ready order, and the buckets are
    rebuilt before the next trial, between the steps (`InProcessRunner._run`): its journal's
    residents are the rebuilt buckets, laid out for the deep model."""
    spec = _ddp("qwen2", 10, "none", 4, lora=False, **_WIDE)
    replayed = EstimateRunner(spec, gpu=A100)
    whole = EstimateRunner(spec, gpu=A100, layer_replay=False)
    assert replayed.step_time_s(1, 2) == pytest.approx(whole.step_time_s(1, 2), rel=RELATIVE)
    single_rank._the_same(replayed.trial(2, 2), whole.trial(2, 2))
    single_rank._the_same(
        replayed.trial(1, checkpointing=True), whole.trial(1, checkpointing=True)
    )
    assert replayed.layer_replay and replayed.speed_replay
    # The buckets' bytes it states are the deep model's.
    assert replayed.device_info == whole.device_info


@pytest.mark.e2e
def test_partial_checkpointing_of_a_ddp_rank_replayed_is_the_whole_trace_to_the_byte() -> None:
    spec = _ddp("llama", 10, "none", 4, lora=False, **_WIDE)
    replayed = EstimateRunner(spec, capacity_bytes=640 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=640 * MiB, layer_replay=False)
    single_rank._the_same(replayed.warm_up(checkpointing=True), traced.warm_up(checkpointing=True))
    single_rank.every_partial_trial_the_same(
        replayed, traced, (1, 6, 9), [(1, 1), (2, 2), (32, 1)]
    )


@pytest.mark.e2e
@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_counts_of_partial_checkpointing_written_out_from_one_kept_journal(sharding: str) -> None:
    """After the warm-up a DDP rank's step starts from the rebuilt buckets whatever ran before
    (the reducer rebuilds them between steps), so its shallow journals are kept as one rank's
    are: 5 and 6 of 12 blocks are one shallow step, traced once and written out twice, each
    the whole trace to the byte."""
    spec = _ddp("llama", 12, sharding, 2, lora=False)
    replayed = EstimateRunner(spec, capacity_bytes=48 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=48 * MiB, layer_replay=False)
    single_rank._the_same(replayed.warm_up(checkpointing=True), traced.warm_up(checkpointing=True))
    trials = [(1, 1), (2, 2), (32, 1)]
    single_rank.every_partial_trial_the_same(replayed, traced, (5,), trials)
    assert replayed._partial is not None
    kept = dict(replayed._partial._journals)
    assert len(kept) == len(trials)
    single_rank.every_partial_trial_the_same(replayed, traced, (6,), trials)
    # No step traced again: the same journals, the same objects.
    journals = replayed._partial._journals
    assert journals.keys() == kept.keys() and all(journals[k] is kept[k] for k in kept)


def every_trial_after_an_optimizer_out_of_memory_the_same(
    spec: Spec, capacity_bytes: int
) -> StepOutcome:
    """A first step (the warm-up) that runs out in the optimizer has completed its
    synchronised backward, so DDP's reducer is due to rebuild its buckets before the next
    forward; between steps, so no trial holds the old buckets beside the new ones (the whole
    model's trial after it then ran out making the new ones in the forward, 25 MiB, while the
    replay's fell back to a fresh whole model that ran out in the optimizer). Every trial after
    it, replayed from the rebuilt buckets, is the whole trace to the byte. Returns the
    warm-up's outcome."""
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    warm = replayed.warm_up()
    single_rank._the_same(warm, traced.warm_up())
    assert warm.oom_phase is Phase.OPTIMIZER
    # Out in the optimizer again (the rebuilt buckets are the old ones' bytes), in the
    # backward with accumulation, in the forward at a larger micro-batch, and after them.
    trials = [(1, 1, False), (1, 2, False), (2, 1, False), (1, 1, True), (1, 1, False)]
    outcomes = []
    for micro_batch, accumulation, checkpointing in trials:
        outcome = replayed.trial(micro_batch, accumulation, checkpointing=checkpointing)
        single_rank._the_same(
            outcome, traced.trial(micro_batch, accumulation, checkpointing=checkpointing)
        )
        outcomes.append(outcome)
    assert outcomes[0].oom_phase is Phase.OPTIMIZER
    assert {o.oom_phase for o in outcomes} >= {Phase.OPTIMIZER, Phase.FORWARD, Phase.BACKWARD}
    assert replayed.layer_replay
    return warm


@pytest.mark.e2e
def test_trials_after_a_warm_up_that_runs_out_in_the_optimizer_are_the_whole_trace() -> None:
    every_trial_after_an_optimizer_out_of_memory_the_same(
        _ddp("llama", 8, "none", 2, lora=False, **_WIDE), 240 * MiB
    )
