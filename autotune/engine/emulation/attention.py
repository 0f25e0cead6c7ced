"""Attention on the emulated GPU, counted as a GPU's fused kernel keeps it.

On CUDA (torch 2.13, compute capability 8.0 or newer), `F.scaled_dot_product_attention` runs the
flash kernel (16-bit, no mask) or the memory-efficient one (a mask, or fp32), with or without
dropout, as long as the head size is a multiple of 8 and at most 256. Both keep only query, key,
value, the output, a per-row logsumexp and the dropout RNG state for backward: never the s x s
attention matrix, which lives in on-chip memory only. On the CPU, torch takes its own flash
kernel only without dropout; with dropout (HF GPT-2 trains with 0.1) or some masks it takes the
math path, which keeps the s x s weights and the dropout mask for backward, and the emulated GPU
would count memory no GPU spends (docs/design.md#attention-kernels).

Inside `gpu_attention()`, such calls run as `_FusedAttention`: its forward and backward compute
on the CPU with the tracker's dispatch modes set aside (the kernel's on-chip work, which no
allocator sees), and only what the GPU kernel allocates is made in view of the tracker: the
output and logsumexp in forward, the three gradients and then the kernel's scratch in backward
(`autotune/core/memory/kernel_scratch.py`), the scratch freed when the op returns. Dropout draws
its mask from a seed kept for backward, as the GPU kernels keep theirs. A boolean mask is turned
into an additive one of the query's dtype in view of the tracker, as torch does on CUDA before it
picks a kernel.
Calls a GPU would also run on the math path (other head sizes, grouped-query attention) are left
alone.

A function mode is not active in backward: `torch.autograd.backward` and `grad` are torch
functions themselves, so the mode is popped when they run and the autograd engine starts
without it. Checkpoint recomputation runs in backward, and it ran the CPU's attention where
forward had run `_FusedAttention`; the two save their tensors in different orders, and
checkpoint hands saved tensors back by position, so backward got the key as the query and the
query as the key. So the mode also wraps the engine call of every backward it sees in itself
(`_engine_under`): recomputation then runs `_FusedAttention` as forward did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from autotune.core.memory.kernel_scratch import AttentionShape, attention_backward_scratch_bytes

# How many calls ran as `_FusedAttention`, in any thread: a speed pass traced along with a trial
# is the speed pass's only if none did (the speed pass times the CPU's kernel there, whose
# kernels the fused one hides; `autotune.engine.replay.layer_replay`).
_fused_calls = 0


def fused_calls() -> int:
    """How many attention calls ran as the fused kernel's emulation so far."""
    return _fused_calls


# Head sizes the fused CUDA kernels take (flash: <= 256; memory-efficient: multiples of 8).
MAX_FUSED_HEAD_DIM = 256
FUSED_HEAD_DIM_MULTIPLE = 8


def _fused_kernel_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> bool:
    head_dim = query.shape[-1]
    return (
        query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and not enable_gqa
        and query.shape[1] == key.shape[1] == value.shape[1]
        and head_dim == key.shape[-1] == value.shape[-1]
        and head_dim <= MAX_FUSED_HEAD_DIM
        and head_dim % FUSED_HEAD_DIM_MULTIPLE == 0
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _flash_kernel_applies(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    # Of the two fused kernels, flash takes 16-bit inputs without a mask (sm80 and newer).
    return mask is None and query.dtype in (torch.bfloat16, torch.float16)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's `convert_boolean_attn_mask`: True keeps a position, False masks it with -inf."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def _autocast(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # `_FusedAttention` is not an op autocast lists, so cast as autocast would: CUDA runs
    # attention in the autocast dtype.
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _no_autocast() -> torch.autocast:
    # The kernel's arithmetic is its own (fp32 accumulation, an fp32 logsumexp), whatever
    # autocast would make of the ops that emulate it.
    return torch.autocast("cpu", enabled=False)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of attention, accumulated in fp32 at least (as the kernels do): output and
    logsumexp."""
    accumulate = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(accumulate) @ key.to(accumulate).transpose(-2, -1)) * scale
    if is_causal:
        s_q, s_k = scores.shape[-2:]
        causal = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores + mask.to(accumulate)
    logsumexp = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - logsumexp.unsqueeze(-1))
    if dropout_p > 0.0:
        generator = torch.Generator().manual_seed(seed)
        keep = torch.rand(weights.shape, generator=generator) >= dropout_p
        weights = weights * keep / (1.0 - dropout_p)
    output = (weights @ value.to(accumulate)).to(query.dtype)
    return output, logsumexp


def _next_seed() -> int:
    # Drawn from torch's generator, as the GPU kernels take a seed and an offset from CUDA's
    # (and keep those, not a mask, for backward): checkpoint recomputation restores the
    # generator's state, and so draws forward's seed again. Drawn out of sight of the tracker
    # and of fake tensors (the estimate), which have no value to read.
    with _disable_current_modes():
        return int(torch.randint(2**62, (), dtype=torch.int64).item())


def _visible(computed: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `computed` allocated in view of the tracker, as the GPU kernel allocates it:
    `empty_like(like)` keeps the input's memory layout (the kernels' output and gradients follow
    the query's (batch, seq, heads, dim) layout, so the usual transpose back is a free view)."""
    out = (
        torch.empty(computed.shape, dtype=computed.dtype)
        if like is None
        else torch.empty_like(like)
    )
    out.copy_(computed)
    return out


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float,
    ) -> torch.Tensor:
        seed = _next_seed() if dropout_p > 0.0 else 0
        with torch.no_grad(), _disable_current_modes(), _no_autocast():
            output, logsumexp = _attention(
                query, key, value, mask, dropout_p, is_causal, scale, seed
            )
        output, logsumexp = _visible(output, like=query), _visible(logsumexp)
        ctx.save_for_backward(query, key, value, mask, logsumexp, output)
        ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.seed = dropout_p, is_causal, scale, seed
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, mask, _logsumexp, _output = ctx.saved_tensors
        # In the kernel's order: the three gradients, then its scratch, alive until it returns.
        grad_q, grad_k, grad_v = (torch.empty_like(t) for t in (query, key, value))
        scratch = [
            torch.empty(size_bytes, dtype=torch.uint8)
            for size_bytes in attention_backward_scratch_bytes(
                AttentionShape(*query.shape), flash=_flash_kernel_applies(query, mask)
            )
        ]
        with torch.enable_grad(), _disable_current_modes(), _no_autocast():
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            output, _ = _attention(
                q, k, v, mask, ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.seed
            )
            grads = torch.autograd.grad(output, (q, k, v), grad_output)
            for visible, computed in zip((grad_q, grad_k, grad_v), grads, strict=True):
                visible.copy_(computed)
        del scratch
        return grad_q, grad_k, grad_v, None, None, None, None


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with a GPU fused kernel's memory, where a GPU fuses it."""
    query, key, value = _autocast((query, key, value))
    if not _fused_kernel_applies(query, key, value, enable_gqa):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    global _fused_calls
    _fused_calls += 1
    mask = None if attn_mask is None else _additive(attn_mask, query.dtype)
    softmax_scale = scale if scale is not None else query.shape[-1] ** -0.5
    output: torch.Tensor = _FusedAttention.apply(  # type: ignore[no-untyped-call]
        query, key, value, mask, dropout_p, is_causal, softmax_scale
    )
    return output


# Where backward enters the autograd engine: `torch.autograd.backward` and `grad` (and so
# `Tensor.backward`) call this module global once they are past their torch-function check.
_ENGINE_ENTRY = "_engine_run_backward"
_BACKWARD_ENTRIES = (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward)


@contextlib.contextmanager
def _engine_under(mode: Callable[[], TorchFunctionMode]) -> Iterator[None]:
    """While the block runs, this thread's backward passes run the engine under a fresh `mode`:
    the engine keeps the function modes active when it starts, and the mode of the caller is
    popped by then (it is handling the backward call itself)."""
    run_backward = getattr(torch.autograd, _ENGINE_ENTRY)
    owner = threading.get_ident()

    def under_mode(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return run_backward(*args, **kwargs)
        with mode():
            return run_backward(*args, **kwargs)

    setattr(torch.autograd, _ENGINE_ENTRY, under_mode)
    try:
        yield
    finally:
        setattr(torch.autograd, _ENGINE_ENTRY, run_backward)


class _GpuAttention(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is F.scaled_dot_product_attention:
            return fused_attention(*args, **(kwargs or {}))
        if func in _BACKWARD_ENTRIES:
            with _engine_under(_GpuAttention):
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def gpu_attention() -> TorchFunctionMode:
    """A context in which attention keeps for backward what a GPU's fused kernel keeps."""
    return _GpuAttention()


__all__ = ["fused_attention", "fused_calls", "gpu_attention"]
