"""Out-of-memory as a value: what counts as one, and every other error left untouched."""

from __future__ import annotations

import torch

from autotune.engine.devices.out_of_memory import is_out_of_memory
from autotune.engine.devices.simulated_cuda import (
    CUBLAS_ALLOC_FAILED,
    CUDNN_INTERNAL_ERROR,
    CUDNN_NOT_SUPPORTED,
)


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


def test_cuda_libraries_out_of_memory_is_out_of_memory() -> None:
    # torch's messages (aten/src/ATen/cuda/Exceptions.h), as the simulated backend raises them.
    assert is_out_of_memory(RuntimeError(CUBLAS_ALLOC_FAILED))
    assert is_out_of_memory(RuntimeError(CUDNN_INTERNAL_ERROR))
    assert is_out_of_memory(
        RuntimeError(CUDNN_INTERNAL_ERROR + "\nInput shapes: [64, 3, 224, 224]")
    )
    # cuDNN refusing a convolution is "too big" above micro-batch 1 only: at 1 nothing is
    # smaller to try, so it is a real error there.
    assert is_out_of_memory(RuntimeError(CUDNN_NOT_SUPPORTED), micro_batch=2)
    assert not is_out_of_memory(RuntimeError(CUDNN_NOT_SUPPORTED), micro_batch=1)


def test_other_cuda_library_errors_are_not() -> None:
    for message in (
        "CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling `cublasSgemm( handle, opa, ...)`",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( ...)`",
        "cuDNN error: CUDNN_STATUS_BAD_PARAM",
        "cuDNN error: CUDNN_STATUS_MAPPING_ERROR",
        # cuDNN 9's refined codes: an architecture mismatch is not a size problem.
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH. This error may appear if you "
        "passed in a non-contiguous input.",
        "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
    ):
        assert not is_out_of_memory(RuntimeError(message), micro_batch=64), message
