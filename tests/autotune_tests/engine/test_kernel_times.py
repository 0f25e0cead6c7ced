"""The traced step's kernels (autotune/engine/kernel_times.py): what launches a kernel and what
only relabels a tensor's shape, and what an in-place kernel moves."""

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
ASSUMPTIONS = RooflineAssumptions()
FP32 = 4


def _copy_s(nbytes: int) -> float:
    """A kernel of no arithmetic moving `nbytes` of fp32 on the H100."""
    return op_time_s(H100.gpu, ASSUMPTIONS, flops=0, bytes_moved=nbytes, dtype="fp32")


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
    copy-out (the gathered unit) per unit, each read and written once; gathering in 16 bits,
    plus the cast of the rank's fp32 shard into a 16-bit one before the copy-in (FSDP2's
    `_foreach_copy_`, in place: its destination read and written, as `copy_`'s)."""
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

    def cast_s(shard_bytes: int, cast_bytes: int) -> float:
        nbytes = shard_bytes + 2 * cast_bytes
        return op_time_s(H100.gpu, assumptions, flops=0, bytes_moved=nbytes, dtype="bf16")

    gathers_s = sum(
        copy_s(unit.gathered_bytes(ranks, element_size) // ranks)
        + copy_s(unit.gathered_bytes(ranks, element_size))
        for unit in units
    )
    if element_size is not None:
        gathers_s += sum(
            cast_s(unit.gathered_bytes(ranks) // ranks, unit.gathered_bytes(ranks, 2) // ranks)
            for unit in units
        )
    assert len(units) == 4  # three layers and the root
    assert times_s["zero3"] - times_s["zero2"] == pytest.approx(gathers_s, rel=1e-9)


def test_an_in_place_kernel_moves_what_it_reads_and_what_it_writes() -> None:
    """An in-place op writes its tensors once: `add_` returns self (its output, once), a foreach
    op returns nothing (its written list is its output), an `out=` is returned."""
    times = KernelTimes(H100, ASSUMPTIONS, tf32=False)
    with FakeTensorMode():
        xs = [torch.empty(1000), torch.empty(24, 10)]
        ys = [torch.empty_like(x) for x in xs]
        a, b, c = torch.empty(8, 16), torch.empty(16, 4), torch.empty(8, 4)
        with times:
            xs[0].add_(ys[0])
            torch._foreach_mul_(xs, 2.0)
            torch._foreach_addcdiv_(xs, ys, ys, 0.5)
            torch.mm(a, b, out=c)
    mm_flops = 2 * 8 * 16 * 4
    mm_s = op_time_s(
        H100.gpu, ASSUMPTIONS, flops=mm_flops, bytes_moved=FP32 * (128 + 64 + 32), dtype="fp32"
    )
    numel = 1000 + 240
    expected_s = _copy_s(FP32 * 3 * 1000) + _copy_s(FP32 * 2 * numel)
    expected_s += _copy_s(FP32 * 4 * numel) + mm_s
    assert times.time_s == pytest.approx(expected_s, rel=1e-12)


def _adamw_step_s(**kind: bool) -> tuple[float, int]:
    """The second step's time of AdamW on two parameters, and their elements."""
    times = KernelTimes(H100, ASSUMPTIONS, tf32=False)
    with FakeTensorMode():
        parameters = [torch.nn.Parameter(torch.empty(64, 32)), torch.nn.Parameter(torch.empty(96))]
        for parameter in parameters:
            parameter.grad = torch.empty_like(parameter)
        optimizer = torch.optim.AdamW(parameters, **kind)
        optimizer.step()  # makes the state
        with times:
            optimizer.step()
    return times.time_s, sum(p.numel() for p in parameters)


def test_a_foreach_adamw_step_moves_its_parameters_gradients_and_moments() -> None:
    """Every in-place foreach kernel of AdamW's step reads its lists and writes its first (they
    return nothing, and were missed: only `_foreach_sqrt` was timed). `P`: one fp32 list."""
    time_s, numel = _adamw_step_s(foreach=True)
    p = FP32 * numel
    # Weight decay on the parameters (read and write), the first moment's lerp toward the
    # gradient, the second's scaling and its addcmul of the gradient squared (gradient read
    # twice), its square root, the root's division by the bias correction and its epsilon, and
    # the parameters' addcdiv. The step counters' increment launches nothing: a CUDA run keeps
    # them on the CPU.
    bytes_moved = [2 * p, 3 * p, 2 * p, 4 * p, 2 * p, 2 * p, 2 * p, 4 * p]
    assert time_s == pytest.approx(sum(_copy_s(n) for n in bytes_moved), rel=1e-12)


def test_a_fused_adamw_step_moves_its_parameters_gradients_and_moments() -> None:
    """The fused kernel reads the parameters, gradients, both moments and the step counters,
    and writes the parameters and moments (not the gradients: no gradient scale); the step
    counters' increment before it is not timed (as the foreach step's: see there)."""
    time_s, numel = _adamw_step_s(fused=True)
    p = FP32 * numel
    steps = 2 * FP32
    assert time_s == pytest.approx(_copy_s(4 * p + steps + 3 * p), rel=1e-12)


def test_a_fused_adamw_writes_the_gradients_it_unscales() -> None:
    times = KernelTimes(H100, ASSUMPTIONS, tf32=False)
    with FakeTensorMode():
        lists = [[torch.empty(100)] for _ in range(4)]
        steps = [torch.empty(())]
        scale, found_inf = torch.empty(()), torch.empty(())
        with times:
            torch._fused_adamw_(
                *lists, [], steps, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0,
                eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale, found_inf=found_inf,
            )  # fmt: skip
    read = FP32 * (4 * 100 + 3)
    assert times.time_s == pytest.approx(_copy_s(read + FP32 * 4 * 100), rel=1e-12)


def test_a_sharded_ranks_adamw_step_moves_its_shards() -> None:
    """An FSDP2 rank's parameters, gradients and moments are DTensors of the global shape; the
    rank's foreach kernels move its local shards (the global shape counted 4 times the bytes
    on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from autotune.engine.training.sharding import process_group

    process_group(4)
    mesh = init_device_mesh("cpu", (4,))
    shards = [torch.empty(16, 32), torch.empty(24)]
    parameters = [
        torch.nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)])) for shard in shards
    ]
    for parameter in parameters:
        parameter.grad = DTensor.from_local(
            torch.empty_like(parameter.to_local()), mesh, [Shard(0)]
        )
    optimizer = torch.optim.AdamW(parameters, foreach=True)
    optimizer.step()  # makes the state
    times = KernelTimes(H100, ASSUMPTIONS, tf32=False)
    with times:
        optimizer.step()
    global_s, numel = _adamw_step_s(foreach=True)
    assert sum(p.to_local().numel() for p in parameters) == 16 * 32 + 24
    assert numel == 64 * 32 + 96  # `_adamw_step_s`'s parameters: these shards' global shapes
    p = FP32 * (16 * 32 + 24)
    bytes_moved = [2 * p, 3 * p, 2 * p, 4 * p, 2 * p, 2 * p, 2 * p, 4 * p]
    assert times.time_s == pytest.approx(sum(_copy_s(n) for n in bytes_moved), rel=1e-12)
    assert global_s > times.time_s  # what the global shapes would move
