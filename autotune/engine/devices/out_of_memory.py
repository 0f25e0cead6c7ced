"""Out-of-memory as a value: the ONLY module in the project that catches out-of-memory.

Both devices (`autotune.engine.devices.device.EmulatedDevice`,
`autotune.engine.devices.cuda_device.CudaDevice`) run a trial's step through `run_tracked`, which
turns out-of-memory into the phase that ran out and lets every other exception through unchanged;
`is_out_of_memory` says what counts as one.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable

import torch

from autotune.core.schemas import Phase
from autotune.engine.emulation.tracker import LiveBytesTracker

logger = logging.getLogger(__name__)

# Out-of-memory failures that arrive as a plain RuntimeError: the CPU allocator's (e.g. under
# RLIMIT_AS, see docs/design.md#a-real-cpu-out-of-memory-is-a-signal-not-a-budget), a failed raw
# cudaMalloc outside the caching allocator, and the CUDA libraries' own allocations failing:
# cublasCreate's (torch's TORCH_CUDABLAS_CHECK message) and cuDNN's, which reports it as an
# internal error. Whole status names only: cuDNN 9's refined codes
# (CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED, ...) are other errors.
_OOM_MESSAGES = re.compile(
    r"DefaultCPUAllocator: can't allocate memory"
    r"|CUDA error: out of memory"
    r"|CUDA error: CUBLAS_STATUS_ALLOC_FAILED\b"
    r"|cuDNN error: CUDNN_STATUS_INTERNAL_ERROR(?!_)"
)
# cuDNN refusing a convolution (AT_CUDNN_CHECK's message): at a large batch, the size is what it
# refuses (Lightning's `is_cudnn_snafu` and accelerate's `should_reduce_batch_size` treat it as
# "too big"); at micro-batch 1 there is nothing smaller to try, so it is an error there.
_CUDNN_NOT_SUPPORTED = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. "


def is_out_of_memory(error: BaseException, *, micro_batch: int = 1) -> bool:
    """True for `torch.OutOfMemoryError` (real CUDA or emulated), for the RuntimeErrors that a
    failed CPU allocation, raw cudaMalloc, cuBLAS handle or cuDNN allocation raise, and above
    micro-batch 1 for cuDNN refusing a convolution (`NOT_SUPPORTED`)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    if _OOM_MESSAGES.search(message) is not None:
        return True
    return micro_batch > 1 and _CUDNN_NOT_SUPPORTED in message


def run_tracked(
    step: Callable[[], object], tracker: LiveBytesTracker | None, *, micro_batch: int = 1
) -> Phase | None:
    """Run `step()` under `tracker` (or bare); return None if it completed, else the phase that
    ran out (FORWARD when untracked: nothing labels phases then). `micro_batch` is the step's,
    for `is_out_of_memory`."""
    oom_phase: Phase | None = None
    try:
        if tracker is None:
            step()
        else:
            with tracker:
                step()
    except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error, micro_batch=micro_batch):
            raise
        # Only record here. pytorch#18853: the exception's traceback keeps the step's frames,
        # and with them its tensors, alive; memory is freed only once we have left `except`.
        oom_phase = tracker.phase if tracker is not None else Phase.FORWARD
        logger.debug("trial ran out of memory in %s: %s", oom_phase.value, error)
    if oom_phase is not None:
        gc.collect()
    return oom_phase


def peak_phase(phase_peak_bytes: dict[Phase, int]) -> Phase | None:
    """The phase with the highest peak: where a completed step over its capacity ran out."""
    return max(phase_peak_bytes, key=phase_peak_bytes.__getitem__, default=None)
