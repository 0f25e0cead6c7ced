"""The traced step's kernels (autotune/engine/kernel_times.py): what launches a kernel and what
only relabels a tensor's shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.gpus.roofline import RooflineAssumptions
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
