"""What CUDA kernels allocate for themselves inside one op and free at its end (no torch).

A kernel's scratch is allocated through the caching allocator like any tensor, so it counts
against the card while the op runs, but the CPU kernels that stand in for it on the emulated GPU
never allocate it. This module sizes it per op, from torch 2.13's CUDA sources, as the block
sizes the allocator is asked for (docs/design.md#per-op-workspaces):

- **Flash attention backward** (`mha_bwd` of the flash-attention
  kernels torch bundles): besides dq, dk, dv it allocates `softmax_d`
  (batch, heads, seq_q rounded to 128) and, since `loop` is always true and
  `deterministic` is off by default, `dq_accum` (batch, seq_q rounded to 128, heads, head size
  rounded to 32, or to 64 above 128), both fp32; both die when the op returns.
- **Memory-efficient attention backward** (`_efficient_attention_backward`, cutlass): `delta`
  (batch, heads, seq_q) fp32 and a workspace of fp32 tiles holding dQ's accumulator, whose tile
  shape depends on the kernel picked for the architecture and head size. Counted as one fp32
  copy of the query rounded to 64 x 64 tiles: an estimate, stated as such.
- **cuDNN convolution**: no allowance. Its workspace never makes a step run out: the v8 API
  (`Conv_v8.cpp`, `generate_and_filter_plans`) halves the workspace on out-of-memory and keeps
  only the plans that fit it, and the v7 API tries the next algorithm; an algorithm without
  workspace always exists. A tight card makes convolutions slower, not the step fail.
- **cuBLAS**: its workspaces are allocated once per handle and kept (`cuda_reserve.py`), not
  per op.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4
# mha_bwd: seqlen_q rounded to 128; head_size to 32, or to 64 above 128
FLASH_SEQ_ROUNDING = 128
FLASH_SMALL_HEAD_MAX = 128
# The memory-efficient kernels' dQ accumulator tiles, taken as 64 x 64 (an estimate).
EFFICIENT_TILE = 64

CONV_WORKSPACE_REASON = (
    "cuDNN convolution workspaces: no allowance; on out-of-memory cuDNN falls back to plans "
    "with smaller or no workspace (slower, never out of memory)"
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: query (batch, heads, seq_q, head_dim) against seq_k keys."""

    batch: int
    heads: int
    seq_q: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_q", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def flash_backward_scratch_bytes(shape: AttentionShape) -> tuple[int, ...]:
    """The flash kernel's backward scratch, one entry per allocation: softmax_d, dq_accum."""
    seq_rounded = _round_up(shape.seq_q, FLASH_SEQ_ROUNDING)
    head_rounded = _round_up(shape.head_dim, 32 if shape.head_dim <= FLASH_SMALL_HEAD_MAX else 64)
    softmax_d = shape.batch * shape.heads * seq_rounded * FP32_BYTES
    dq_accum = shape.batch * seq_rounded * shape.heads * head_rounded * FP32_BYTES
    return (softmax_d, dq_accum)


def efficient_backward_scratch_bytes(shape: AttentionShape) -> tuple[int, ...]:
    """The memory-efficient kernel's backward scratch: delta, then the dQ workspace (estimate)."""
    delta = shape.batch * shape.heads * shape.seq_q * FP32_BYTES
    tiles = _round_up(shape.seq_q, EFFICIENT_TILE) * _round_up(shape.head_dim, EFFICIENT_TILE)
    workspace = shape.batch * shape.heads * tiles * FP32_BYTES
    return (delta, workspace)


def attention_backward_scratch_bytes(shape: AttentionShape, *, flash: bool) -> tuple[int, ...]:
    """The scratch of whichever fused kernel runs: flash (16-bit, no mask) or memory-efficient."""
    return (
        flash_backward_scratch_bytes(shape) if flash else efficient_backward_scratch_bytes(shape)
    )


__all__ = [
    "CONV_WORKSPACE_REASON",
    "AttentionShape",
    "attention_backward_scratch_bytes",
    "efficient_backward_scratch_bytes",
    "flash_backward_scratch_bytes",
]
