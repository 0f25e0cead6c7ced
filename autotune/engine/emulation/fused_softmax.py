"""CUDA's fused fp16 -> fp32 softmax, for the emulated GPU.

`softmax(x, dim, dtype=float32)` and `log_softmax` on an fp16 CUDA tensor (what autocast asks
for) run one kernel that reads fp16 and writes fp32 (ATen's
`_softmax(x, dim, half_to_float=True)`); elsewhere, and for bf16, the composite first makes an fp32
copy of x. The CPU has no such kernel, so `softmax_half_to_float` stands in for it: its fp32
copy is its own scratch, which a dispatch mode (the emulated GPU's tracker) never sees, as no
allocator sees a kernel's registers. Backward is fused the same way
(`_softmax_backward_data(..., input_dtype=half)`): an fp16 gradient straight from the fp32 one
(docs/design.md#autocast-on-the-emulated-gpu).
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("autotune::softmax_half_to_float", mutates_args=())
def softmax_half_to_float(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """(log_)softmax of an fp16 tensor, written in fp32, as CUDA's fused kernel."""
    op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
    result: torch.Tensor = op(x.float(), dim, False)
    return result


@softmax_half_to_float.register_fake
def _(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("autotune::softmax_backward_to_half", mutates_args=())
def softmax_backward_to_half(
    grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool
) -> torch.Tensor:
    """The fp16 input gradient of `softmax_half_to_float`, from its fp32 output."""
    op = (
        torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    )
    result: torch.Tensor = op(grad, output, dim, torch.float32).half()
    return result


@softmax_backward_to_half.register_fake
def _(grad: torch.Tensor, output: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return torch.empty_like(output, dtype=torch.float16)


def _save_output(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    # What SoftmaxBackward0 and LogSoftmaxBackward0 keep: the result, nothing else.
    ctx.dim, ctx.log = inputs[1], inputs[2]
    ctx.save_for_backward(output)


def _softmax_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    (output,) = ctx.saved_tensors
    return softmax_backward_to_half(grad, output, ctx.dim, ctx.log), None, None


softmax_half_to_float.register_autograd(_softmax_backward, setup_context=_save_output)

__all__ = ["softmax_backward_to_half", "softmax_half_to_float"]
