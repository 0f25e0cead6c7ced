"""Out-of-memory as a value: what counts as one, and every other error left untouched."""

from __future__ import annotations

import torch

from autotune.engine.out_of_memory import is_out_of_memory


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    cpu_failure = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 419430400 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert is_out_of_memory(RuntimeError(cpu_failure))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(MemoryError())
