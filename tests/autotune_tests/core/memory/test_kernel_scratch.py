"""The per-op scratch of CUDA kernels (autotune/core/memory/kernel_scratch.py), sized by hand from
the formulas of torch 2.13's flash_api.cpp (mha_bwd) and the memory-efficient kernel's backward."""

from __future__ import annotations

import pytest

from autotune.core.memory.kernel_scratch import (
    AttentionShape,
    attention_backward_scratch_bytes,
    efficient_backward_scratch_bytes,
    flash_backward_scratch_bytes,
)


def test_flash_rounds_the_sequence_to_128_and_small_heads_to_32() -> None:
    # GPT-2 124M at 1024: nothing to round; softmax_d 12 x 1024 fp32, dq_accum 1024 x 12 x 64.
    assert flash_backward_scratch_bytes(AttentionShape(1, 12, 1024, 64)) == (
        48 * 1024,
        3 * 2**20,
    )
    # 129 -> 256 rows; head 40 -> 64.
    assert flash_backward_scratch_bytes(AttentionShape(2, 3, 129, 40)) == (
        2 * 3 * 256 * 4,
        2 * 256 * 3 * 64 * 4,
    )


def test_flash_rounds_heads_above_128_to_64() -> None:
    # 128 stays 128 (the 32 rule); 136 goes to 192, not to 160.
    assert flash_backward_scratch_bytes(AttentionShape(1, 1, 128, 128))[1] == 128 * 128 * 4
    assert flash_backward_scratch_bytes(AttentionShape(1, 1, 128, 136))[1] == 128 * 192 * 4


def test_the_efficient_kernel_keeps_an_unrounded_delta_and_64_tiles() -> None:
    assert efficient_backward_scratch_bytes(AttentionShape(2, 4, 200, 40)) == (
        2 * 4 * 200 * 4,
        2 * 4 * 256 * 64 * 4,
    )


def test_the_kernel_is_chosen_by_the_caller() -> None:
    shape = AttentionShape(1, 2, 300, 8)
    assert attention_backward_scratch_bytes(shape, flash=True) == flash_backward_scratch_bytes(
        shape
    )
    assert attention_backward_scratch_bytes(
        shape, flash=False
    ) == efficient_backward_scratch_bytes(shape)


@pytest.mark.parametrize("field", ["batch", "heads", "seq_q", "head_dim"])
def test_empty_shapes_are_refused_by_name(field: str) -> None:
    sizes = {"batch": 1, "heads": 1, "seq_q": 1, "head_dim": 8, field: 0}
    with pytest.raises(ValueError, match=field):
        AttentionShape(**sizes)
