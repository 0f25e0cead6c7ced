"""The stand-in for CUDA's fused fp16 -> fp32 softmax
(`autotune.engine.emulation.fused_softmax`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotune.engine.emulation.autocast import cuda_autocast_policy
from autotune.engine.emulation.fused_softmax import softmax_half_to_float
from autotune.engine.emulation.tracker import LiveBytesTracker

ROWS, COLS = 64, 1024


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_values_and_gradient_are_those_of_fp32_softmax(log: bool) -> None:
    x = torch.randn(ROWS, COLS).half().requires_grad_()
    reference_input = x.detach().float().requires_grad_()
    fn = F.log_softmax if log else F.softmax
    grad = torch.randn(ROWS, COLS)

    out = softmax_half_to_float(x, -1, log)
    out.backward(grad)
    reference = fn(reference_input, -1)
    reference.backward(grad)

    assert out.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.float16
    torch.testing.assert_close(out, reference)
    assert reference_input.grad is not None
    torch.testing.assert_close(x.grad, reference_input.grad.half())


def _softmax_peak_bytes(x: torch.Tensor, low: torch.dtype) -> int:
    tracker = LiveBytesTracker(None, block_bytes=1)
    tracker.add_resident([x])
    with cuda_autocast_policy(), torch.no_grad(), torch.autocast("cpu", dtype=low), tracker:
        F.softmax(x, -1)
    return tracker.peak_bytes


def test_the_emulated_gpu_counts_no_fp32_copy_of_an_fp16_input() -> None:
    """CUDA's kernel reads fp16 and writes fp32: the input and the output, nothing else. bf16
    has no such kernel on CUDA either: its fp32 copy is counted."""
    fp32_bytes = ROWS * COLS * 4
    x16 = torch.randn(ROWS, COLS).half()
    assert _softmax_peak_bytes(x16, torch.float16) == x16.nbytes + fp32_bytes
    x_bf16 = torch.randn(ROWS, COLS).bfloat16()
    assert _softmax_peak_bytes(x_bf16, torch.bfloat16) == x_bf16.nbytes + 2 * fp32_bytes
