"""Sharded data parallel: one rank of ZeRO-1/2/3 and hybrid sharding in one process (torch's own
FSDP2 and ZeroRedundancyOptimizer over a fake process group), checked against two real gloo
ranks on the CPU and against the arithmetic of what a rank keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn
from torch.utils._python_dispatch import _disable_current_modes

from autotune.core.schemas import Phase, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.emulation.tracker import local_tensor
from autotune.engine.estimate import EstimateRunner
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.sharding import blocks
from tests.autotune_tests.engine.replay.test_layer_replay import _config as replay_config
from tests.autotune_tests.engine.replay.test_layer_replay import _spec as replay_spec
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG
from tests.autotune_tests.gloo import run_gloo_rank

pytestmark = pytest.mark.xdist_group("real-fsdp")

MiB = 2**20
HUGE_BYTES = 2**40
TRIALS = [(2, 1), (6, 2)]  # (micro-batch, accumulation steps)
CHECKED = ("zero2", "zero3")
TOLERANCE = 0.02


def _spec(sharding: str = "none", world_size: int = 2, **training: object) -> Spec:
    return Spec.model_validate(
        {
            "model": {"preset": "llama-tiny"},
            "training": {
                "seq_len": 32,
                "world_size": world_size,
                "sharding": sharding,
                "max_micro_batch": 64,
                **training,
            },
        }
    )


Peaks = list[tuple[int, int]]  # (peak reserved, peak allocated) per trial


def _trials(sharding: str) -> Peaks:
    runner = InProcessRunner(_spec(sharding), EmulatedDevice(HUGE_BYTES))
    assert runner.warm_up().fits
    peaks = []
    for micro_batch, accumulation in TRIALS:
        outcome = runner.trial(micro_batch, accumulation)
        assert outcome.fits and outcome.peak_allocated_bytes is not None
        peaks.append((outcome.peak_bytes, outcome.peak_allocated_bytes))
    return peaks


def _collectives_on_untracked_buffers() -> None:
    """Two differences of gloo on the CPU from NCCL on a GPU, taken out of the real ranks: gloo's
    reduce-scatter copies its whole input (a unit's gradients) into a temporary, which NCCL does
    not; and gloo's worker threads hold the tensors of a collective until they are done with
    it, so a buffer FSDP2 frees is freed late, by a timing the trackers see. The real ranks run
    each collective of FSDP2 on copies the tracker does not see, and copy the result into
    FSDP2's buffer: the same values, FSDP2's allocations as FSDP2 makes them."""
    all_gather_into_tensor, all_reduce = dist.all_gather_into_tensor, dist.all_reduce

    def all_gather_single(
        output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> None:
        with _disable_current_modes():
            gathered = torch.empty_like(output)
            all_gather_into_tensor(gathered, input.clone(), group=group)
            output.copy_(gathered)

    def reduce_scatter_single(
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> None:
        with _disable_current_modes():
            total = input.clone()
            all_reduce(total, op=op, group=group)
            chunk = total.numel() // dist.get_world_size(group)
            start = dist.get_rank(group) * chunk
            output.view(-1).copy_(total.view(-1)[start : start + chunk])

    dist.all_gather_single = all_gather_single  # type: ignore[assignment]
    dist.reduce_scatter_single = reduce_scatter_single  # type: ignore[assignment]


def _real_rank(rank: int, workdir: str) -> None:  # run by run_gloo_rank
    _collectives_on_untracked_buffers()
    # The training step finds the launched job's process group and shards over it.
    torch.save({sharding: _trials(sharding) for sharding in CHECKED}, f"{workdir}/{rank}.pt")


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Peaks]]:
    workdir = tmp_path_factory.mktemp("fsdp")
    spawn(run_gloo_rank, args=(_real_rank, str(workdir)), nprocs=2, join=True)  # type: ignore[no-untyped-call]
    return [torch.load(Path(workdir) / f"{rank}.pt") for rank in (0, 1)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sharding", CHECKED)
def test_two_real_gloo_fsdp2_ranks_peak_as_the_emulated_rank(
    real_ranks: list[dict[str, Peaks]], sharding: str
) -> None:
    emulated = _trials(sharding)
    for rank in real_ranks:
        for (micro_batch, _), (reserved, allocated), (real_reserved, real_allocated) in zip(
            TRIALS, emulated, rank[sharding], strict=True
        ):
            assert real_allocated == pytest.approx(allocated, rel=TOLERANCE), micro_batch
            assert real_reserved == pytest.approx(reserved, rel=TOLERANCE), micro_batch


def _resident_bytes(runner: InProcessRunner) -> int:
    return sum(
        local_tensor(t).untyped_storage().nbytes()
        for t in runner.step.resident_tensors()
        if t.dim() > 0  # AdamW's step counters
    )


@pytest.mark.e2e
def test_zero3_lowers_a_rank_s_memory_as_the_arithmetic_says() -> None:
    whole = InProcessRunner(_spec(world_size=1), EmulatedDevice(HUGE_BYTES))
    assert whole.warm_up().fits
    params = sum(p.numel() for p in whole.step.model.parameters())
    optimizer_peak = whole.trial(2).phase_peak_bytes[Phase.OPTIMIZER]
    previous_peak = whole.trial(2).peak_allocated_bytes
    for ranks in (2, 4):
        runner = InProcessRunner(_spec("zero3", world_size=ranks), EmulatedDevice(HUGE_BYTES))
        assert runner.warm_up().fits
        # Between steps a rank keeps its shard of the fp32 weights and of AdamW's two moments:
        # 12 bytes per parameter over the ranks (FSDP2 pads each to a multiple of the ranks).
        assert _resident_bytes(runner) == pytest.approx(12 * params / ranks, rel=0.005)
        outcome = runner.trial(2)
        # The optimizer step touches only shards: the whole step's peak there, divided.
        assert outcome.phase_peak_bytes[Phase.OPTIMIZER] == pytest.approx(
            optimizer_peak / ranks, rel=0.01
        )
        # The forward holds the resident shards and at least one gathered block besides.
        block_bytes = max(
            sum(4 * p.numel() for p in block.parameters()) for block in blocks(runner.step.model)
        )
        assert outcome.phase_peak_bytes[Phase.FORWARD] >= 12 * params / ranks + block_bytes
        assert outcome.peak_allocated_bytes is not None and previous_peak is not None
        assert outcome.peak_allocated_bytes < previous_peak
        previous_peak = outcome.peak_allocated_bytes


@pytest.mark.e2e
def test_each_stage_shards_more_and_fits_more() -> None:
    resident = {}
    for sharding in ("none", "zero1", "zero2", "zero3"):
        runner = InProcessRunner(_spec(sharding), EmulatedDevice(HUGE_BYTES))
        assert runner.warm_up().fits
        resident[sharding] = _resident_bytes(runner)
        assert any(sharding in a for a in runner.device_info.assumptions) or sharding == "none"
    # DDP keeps its gradient buckets; ZeRO-1 shards the moments; ZeRO-2 (FSDP2) and ZeRO-3 keep
    # sharded weights between steps.
    assert resident["none"] > resident["zero1"] > resident["zero2"] == resident["zero3"]
    # 200 MiB hold 12 samples on a DDP rank and 21 on a ZeRO-3 rank (with the residents where
    # the warm-up placed them, every size from 8 to 12 fits on DDP's and none from 13 to 25;
    # on ZeRO-3's every size from 8 to 21, none from 22 to 25).
    fits = {}
    for sharding in ("none", "zero3"):
        runner = InProcessRunner(_spec(sharding), EmulatedDevice(200 * MiB))
        assert runner.warm_up().fits
        fits[sharding] = [runner.trial(b).fits for b in (12, 18)]
    assert fits == {"none": [True, False], "zero3": [True, True]}


@pytest.mark.e2e
def test_hybrid_shards_within_its_group() -> None:
    hybrid = InProcessRunner(
        _spec("hybrid", world_size=4, shard_group_size=2), EmulatedDevice(HUGE_BYTES)
    )
    zero3 = InProcessRunner(_spec("zero3", world_size=2), EmulatedDevice(HUGE_BYTES))
    for runner in (hybrid, zero3):
        assert runner.warm_up().fits
    assert _resident_bytes(hybrid) == _resident_bytes(zero3)


@pytest.mark.e2e
def test_the_estimate_traces_a_sharded_rank() -> None:
    spec = _spec("zero3", world_size=4)
    estimate = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    emulated = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))
    for checkpointing in (False, True):
        a = estimate.trial(3, checkpointing=checkpointing)
        b = emulated.trial(3, checkpointing=checkpointing)
        assert (a.peak_bytes, a.peak_allocated_bytes) == (b.peak_bytes, b.peak_allocated_bytes)


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"sharding": "zero3", "world_size": 1}, "training.sharding: zero3 shards across ranks"),
        ({"sharding": "hybrid", "world_size": 8}, "training.shard_group_size: hybrid sharding"),
        (
            {"sharding": "hybrid", "world_size": 8, "shard_group_size": 3},
            "training.shard_group_size: 3 must divide world_size 8",
        ),
        ({"world_size": 8, "shard_group_size": 4}, "training.shard_group_size: only for"),
    ],
)
def test_sharding_settings_are_checked_by_field(training: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Spec.model_validate({"model": {"preset": "llama-tiny"}, "training": training})


def _forward_peak(layers: int, ranks: int) -> int:
    spec = Spec.model_validate(
        {
            "model": {"hf_config": {**TINY_LLAMA_CONFIG, "num_hidden_layers": layers}},
            "training": {
                "seq_len": 16,
                "precision": "bf16",
                "sharding": "zero3",
                "world_size": ranks,
            },
        }
    )
    runner = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    assert runner.warm_up(checkpointing=True).fits
    return runner.trial(1, checkpointing=True).phase_peak_bytes[Phase.FORWARD]


@pytest.mark.e2e  # 29 s in a clean clone's make test
def test_a_zero3_rank_holds_no_16_bit_copy_of_every_block() -> None:
    """Under bf16 autocast with fp32 master weights, a ZeRO-3 rank gathers each block's weights
    in bf16 (FSDP2's mixed precision) and frees them after it: eight more blocks add their fp32
    shards and one saved input each to the forward's peak, not the 2 bytes per parameter of
    autocast's cached casts of every gathered fp32 block (kept until the forward ends, whatever
    the number of ranks: the reason ZeRO-3 fitted an 8B model on no count of 24 GB cards)."""
    pytest.importorskip("transformers")
    ranks = 16
    extra_blocks = 8
    hidden, ffn = TINY_LLAMA_CONFIG["hidden_size"], TINY_LLAMA_CONFIG["intermediate_size"]
    kv = (
        hidden
        * TINY_LLAMA_CONFIG["num_key_value_heads"]
        // TINY_LLAMA_CONFIG["num_attention_heads"]
    )
    block_params = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    added = _forward_peak(2 + extra_blocks, ranks) - _forward_peak(2, ranks)
    assert added < extra_blocks * 2 * block_params


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("sharding", "model_type", "lora", "capacity_bytes", "too_large"),
    [("zero2", "llama", True, 20 * MiB, 16), ("zero3", "qwen2", False, 32 * MiB, 16)],
)
def test_a_sharded_rank_that_ran_out_starts_its_next_trial_clean(
    sharding: str, model_type: str, lora: bool, capacity_bytes: int, too_large: int
) -> None:
    # An out-of-memory in the forward leaves FSDP2's blocks gathered, their full parameters
    # registered as the model's: the next trial counted them as resident weights (a rank's
    # every gathered block), until the runner reset FSDP2's iteration state.
    spec = replay_spec(replay_config(model_type, 8), lora=lora, world_size=2, sharding=sharding)
    ran_out = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    fresh = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    assert ran_out.warm_up().fits and fresh.warm_up().fits
    failed = ran_out.trial(too_large)
    assert not failed.fits and failed.oom_phase is Phase.FORWARD
    after = ran_out.trial(3, 2, checkpointing=True)
    clean = fresh.trial(3, 2, checkpointing=True)
    assert after.fits
    assert after == clean
    assert after.series == clean.series
    assert after.allocations == clean.allocations


@pytest.mark.e2e
def test_a_backward_cut_short_leaves_no_gradient_for_the_next_trial() -> None:
    # A zero3 rank that runs out inside a block's backward leaves that block's gathered
    # parameters holding their gradients (FSDP2 drops them only after the block's
    # reduce-scatter): the next trial's backward accumulated into them out of place, and ran out
    # at another op with other bytes than a fresh runner's same trial.
    config = replay_config("qwen2", 9, hidden_size=256, intermediate_size=1024)
    spec = replay_spec(config, lora=False, world_size=4, sharding="zero3", seq_len=128)
    ran_out = EstimateRunner(spec, capacity_bytes=60 * MiB, layer_replay=False)
    fresh = EstimateRunner(spec, capacity_bytes=60 * MiB, layer_replay=False)
    assert ran_out.warm_up().fits and fresh.warm_up().fits
    failed = ran_out.trial(4, checkpointing=True)
    assert failed.oom is not None and failed.oom.phase is Phase.BACKWARD
    assert failed.oom.gradients_bytes > 0  # some of the block's gradients were made
    assert ran_out.trial(2, checkpointing=True) == fresh.trial(2, checkpointing=True)
