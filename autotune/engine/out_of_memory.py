"""Out-of-memory as a value: the ONLY module in the project that catches out-of-memory.

Both devices (`autotune.engine.device.EmulatedDevice`, `autotune.engine.cuda_device.CudaDevice`)
run a trial's step through `run_tracked`, which turns out-of-memory into the phase that ran out and
lets every other exception through unchanged; `is_out_of_memory` says what counts as one.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from autotune.core.schemas import Phase
from autotune.engine.tracker import LiveBytesTracker

logger = logging.getLogger(__name__)

# Out-of-memory failures that arrive as a plain RuntimeError: the CPU allocator's (e.g. under
# RLIMIT_AS, see docs/design.md#a-real-cpu-out-of-memory-is-a-signal-not-a-budget) and a
# failed raw cudaMalloc outside the caching allocator.
_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True for `torch.OutOfMemoryError` (real CUDA or emulated) and for the RuntimeErrors that a
    failed CPU allocation or raw cudaMalloc raise."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def run_tracked(step: Callable[[], object], tracker: LiveBytesTracker | None) -> Phase | None:
    """Run `step()` under `tracker` (or bare); return None if it completed, else the phase that
    ran out (FORWARD when untracked: nothing labels phases then)."""
    oom_phase: Phase | None = None
    try:
        if tracker is None:
            step()
        else:
            with tracker:
                step()
    except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
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
