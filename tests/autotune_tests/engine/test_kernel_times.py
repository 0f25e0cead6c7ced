"""The traced step's kernels (autotune/engine/kernel_times.py): what launches a kernel and what
only relabels a tensor's shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.gpus.roofline import RooflineAssumptions, op_time_s
from autotune.engine.kernel_times import KernelTimes

H100 = budget_for(find_gpu("H100 80GB"))


def _time_s(step: str) -> float:
    times = KernelTimes(H100, RooflineAssumptions(), tf32=False)
    with FakeTensorMode(), times:
        x = torch.empty(2, 512, 256, dtype=torch.bfloat16)
        w = torch.empty(128, 256, dtype=torch.bfloat16)
        if step == "linear":
            F.linear(x, w)
        else:
            torch.mm(x.view(1024, 256), w.t())
    return times.time_s


def test_a_linear_on_a_batch_costs_its_matmul_alone() -> None:
    # A linear of a 3-d input is an mm on its 2-d view, its result reshaped by _unsafe_view: a
    # view that aten does not mark as one and that launches no kernel (LoRA's adapters call
    # it 23 times a Llama layer, 4 % of a Llama-3-8B micro-step's roofline before this).
    assert _time_s("linear") == _time_s("mm")


@pytest.mark.e2e
def test_a_zero3_micro_step_pays_for_the_copies_around_its_second_gathers() -> None:
    """FSDP2's copies into the all-gather's input and out of its output are ops of its own
    library that write into buffers they are given; zero3 gathers every unit again for the
    backward, so its micro-step is zero2's plus one copy-in (the rank's shard) and one
    copy-out (the gathered unit) per unit, each read and written once."""
    pytest.importorskip("transformers")
    from autotune.core.parallel.layouts import gathers_in_16_bits
    from autotune.engine.estimate import EstimateRunner
    from autotune.engine.training.sharding import model_parameters
    from tests.autotune_tests.engine.replay.test_layer_replay import _config, _spec

    ranks = 4
    times_s = {}
    for sharding in ("zero2", "zero3"):
        spec = _spec(_config("llama", 3), lora=False, world_size=ranks, sharding=sharding)
        runner = EstimateRunner(spec, gpu=H100)
        assert runner.warm_up(checkpointing=False).fits
        times_s[sharding] = runner.step_time_s(1, 1, checkpointing=False)
        units = model_parameters(runner._runner.step.model).units
        element_size = 2 if gathers_in_16_bits(spec.training) else None
    assumptions = RooflineAssumptions()

    def copy_s(nbytes: int) -> float:
        return op_time_s(H100.gpu, assumptions, flops=0, bytes_moved=2 * nbytes, dtype="bf16")

    gathers_s = sum(
        copy_s(unit.gathered_bytes(ranks, element_size) // ranks)
        + copy_s(unit.gathered_bytes(ranks, element_size))
        for unit in units
    )
    assert len(units) == 4  # three layers and the root
    assert times_s["zero3"] - times_s["zero2"] == pytest.approx(gathers_s, rel=1e-9)
