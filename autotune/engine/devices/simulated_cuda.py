"""A simulated CUDA backend: torch.cuda's device and memory functions, and NVML, for one GPU,
answered by the caching-allocator model (`autotune.core.memory.allocator`) while real steps run on
CPU tensors. It is a `CudaRuntime` (`autotune.engine.devices.cuda_runtime`), so `CudaDevice`'s own
code path runs in CI on a machine without a GPU.

Use it for a whole session, from before the model is built:

    with SimulatedCuda(find_gpu("A100 80GB")) as cuda:
        device = CudaDevice(0, runtime=cuda)
        ...

While it is active, every tensor storage an op creates lives on the simulated GPU: a
`TorchDispatchMode` mallocs it from the allocator model and frees it when Python frees the
storage, and an allocation the model refuses raises `torch.OutOfMemoryError` as torch would.
Outside the allocator it keeps the CUDA context (created at the first use), the kernels loaded
lazily at each op's first run, and the cuBLAS/cuDNN handles created at the first matmul or
convolution of each thread, whose workspaces it allocates through the allocator for the life of
the process (sizes: `autotune.core.gpus.cuda_reserve`). What it models and what it cannot:
docs/design.md#the-simulated-cuda-backend.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.core.gpus.catalogue import Gpu
from autotune.core.gpus.cuda_reserve import (
    BLAS_HANDLE_OPS,
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_SM90_BYTES,
    CUBLASLT_WORKSPACE_BYTES,
    STEP_KERNELS_BYTES,
    context_bytes,
)
from autotune.core.memory.allocator import AllocatorOutOfMemory, BlockId, CachingAllocator
from autotune.core.memory.allocator_config import AllocatorConfig, config_from_environ
from autotune.engine.devices.cuda_runtime import CudaProperties
from autotune.engine.devices.nvml import NvmlLibrary
from autotune.engine.devices.simulated_nvml import NvmlDevice, NvmlState, SimulatedNvml
from autotune.engine.emulation.attention import gpu_attention
from autotune.engine.emulation.tracker import local_tensor

_MiB = 2**20
# Each op's kernels, loaded at its first run, until the kernels of a training step
# (`STEP_KERNELS_BYTES`, calibrated on real cards in autotune.core.gpus.cuda_reserve) are all
# loaded: about 48 distinct ops, what a small transformer's step runs.
KERNEL_MODULE_BYTES = 2 * _MiB
# A cuBLAS or cuDNN handle's own device memory, outside the allocator (its workspaces are in it).
HANDLE_BYTES = 2 * _MiB
# The largest convolution input cuDNN takes before refusing with NOT_SUPPORTED: 32-bit indexing.
CUDNN_MAX_ELEMENTS = 2**31 - 1

MATMUL_OPS = BLAS_HANDLE_OPS
CONVOLUTION_OPS = frozenset({"convolution", "convolution_backward"})

# torch's messages for these failures (its TORCH_CUDABLAS_CHECK and AT_CUDNN_CHECK macros;
# C10_CUDA_CHECK for a failed CUDA call).
CUBLAS_ALLOC_FAILED = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDNN_INTERNAL_ERROR = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"
CUDNN_NOT_SUPPORTED = (
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
    "non-contiguous input."
)
CUDA_OUT_OF_MEMORY = "CUDA error: out of memory"
# The catalogue's cards that have MIG (NVIDIA's MIG user guide, supported GPUs).
MIG_CAPABLE = frozenset({"A100 40GB", "A100 80GB", "H100 80GB", "H200 141GB"})


@dataclass(frozen=True)
class MigSlice:
    """The MIG device the simulated process gets instead of the whole GPU: its profile
    ("3g.40gb"), its memory as CUDA reports it and its SMs."""

    profile: str
    memory_bytes: int
    sm_count: int


class _StorageBlock(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a storage on the simulated GPU, with its allocator block."""

    __slots__ = ("key", "block", "nbytes")

    key: int
    block: BlockId
    nbytes: int


class SimulatedCuda:
    """One simulated GPU (`gpu`, or a MIG slice of it) as torch.cuda and NVML would show it to
    this process; a `CudaRuntime`.

    Args:
        gpu: the card (its CUDA and nvidia-smi totals, SMs for the context's stacks, compute
            capability for cuBLAS's workspace size).
        mig: the MIG device this process gets, when the card is in MIG mode.
        nvml: how NVML answers (`autotune.engine.devices.simulated_nvml.NvmlState`).
        nvml_installed: False: no pynvml at all.
        other_processes_bytes: memory other processes hold on the device.
        allocator_config: the caching allocator's settings (torch's defaults when None).
        environ: the process environment CUDA reads the allocator's settings from when it
            initializes, as torch does at the first tensor on the card (`PYTORCH_ALLOC_CONF`,
            `PYTORCH_CUDA_ALLOC_CONF`); they replace `allocator_config` then. None: not read.
        cudnn_max_elements: the largest convolution input cuDNN accepts.
    """

    cuda_version = "12.4"

    def __init__(
        self,
        gpu: Gpu,
        *,
        mig: MigSlice | None = None,
        nvml: NvmlState = "available",
        nvml_installed: bool = True,
        other_processes_bytes: int = 0,
        allocator_config: AllocatorConfig | None = None,
        environ: Mapping[str, str] | None = None,
        cudnn_max_elements: int = CUDNN_MAX_ELEMENTS,
    ) -> None:
        self._environ = environ
        self.gpu = gpu
        self.mig = mig
        self._nvml_state = nvml
        self._nvml_installed = nvml_installed
        self.total_bytes = mig.memory_bytes if mig is not None else gpu.total_memory_bytes
        self.other_processes_bytes = other_processes_bytes
        self.cudnn_max_elements = cudnn_max_elements
        # What CUDA holds outside the allocator: the bare context (stacks for the SMs this
        # process gets), then kernels and handles as they load.
        sms = replace(gpu, sm_count=mig.sm_count) if mig is not None else gpu
        self.bare_context_bytes = context_bytes(sms) - STEP_KERNELS_BYTES
        self.context_bytes = 0
        self.kernel_bytes = 0
        self.handle_bytes = 0
        self.device_mallocs = 0
        self._loaded_ops: set[str] = set()
        self._handles: set[tuple[str, bool]] = set()
        sm90 = gpu.compute_capability == (9, 0)
        self.blas_workspace_sizes = (
            CUBLAS_WORKSPACE_SM90_BYTES if sm90 else CUBLAS_WORKSPACE_BYTES,
            CUBLASLT_WORKSPACE_BYTES,
        )
        self._allocator = CachingAllocator(
            self._allocator_capacity(), allocator_config, device_total_bytes=self.total_bytes
        )
        self._storages: dict[int, _StorageBlock] = {}
        self._workspaces: list[BlockId] = []  # held for the process's life, as torch does
        self._session: ExitStack | None = None
        name = gpu.nvidia_smi_name
        self.name = f"{name} MIG {mig.profile}" if mig is not None else name
        self.uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"simulated-gpu:{self.name}"))

    # -- the session ------------------------------------------------------------------------

    def __enter__(self) -> SimulatedCuda:
        if self._session is not None:
            raise RuntimeError("this simulated GPU is already active")
        session = ExitStack()
        # Attention keeps what the GPU's fused kernels keep, not what the CPU's kernels keep.
        session.enter_context(gpu_attention())
        session.enter_context(_DeviceMemory(self))
        self._session = session
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._session is not None
        session, self._session = self._session, None
        session.__exit__(exc_type, exc_value, traceback)

    # -- CudaRuntime ------------------------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: int) -> torch.device:
        self._check_index(index)
        return torch.device("cpu")

    def initialize(self, index: int) -> None:
        self._check_index(index)
        if self._session is None:
            raise RuntimeError("enter the SimulatedCuda (a `with` block) before using it")
        if self._environ is not None and self.context_bytes == 0:
            # torch's caching allocator reads its settings once, as CUDA starts: what the
            # environment says then holds for the process's life.
            config = config_from_environ(self._environ)
            self._allocator.reconfigure(config)
            self._allocator.set_memory_fraction(config.per_process_memory_fraction)
        torch.zeros(1)  # as torch's first tensor on the device: the context and one block

    def properties(self, index: int) -> CudaProperties:
        self._check_index(index)
        return CudaProperties(name=self.name, uuid=self.uuid, total_memory_bytes=self.total_bytes)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._check_index(index)
        self._create_context()  # cudaMemGetInfo needs a context
        return self.free_bytes(), self.total_bytes

    def memory_allocated(self, index: int) -> int:
        self._check_index(index)
        return self._allocator.stats.allocated_bytes

    def memory_reserved(self, index: int) -> int:
        self._check_index(index)
        return self._allocator.stats.reserved_bytes

    def max_memory_allocated(self, index: int) -> int:
        self._check_index(index)
        return self._allocator.stats.peak_allocated_bytes

    def max_memory_reserved(self, index: int) -> int:
        self._check_index(index)
        return self._allocator.stats.peak_reserved_bytes

    def num_alloc_retries(self, index: int) -> int:
        self._check_index(index)
        return self._allocator.stats.num_alloc_retries

    def reset_peak_memory_stats(self, index: int) -> None:
        self._check_index(index)
        self._allocator.reset_peaks()

    def empty_cache(self) -> None:
        self._allocator.empty_cache()

    def synchronize(self, index: int) -> None:
        """CPU ops are synchronous: nothing is queued."""
        self._check_index(index)

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None:
        self._check_index(index)
        self._allocator.set_memory_fraction(fraction)

    def nvml(self) -> NvmlLibrary | None:
        if not self._nvml_installed:
            return None
        driver_reserve_bytes = (self.gpu.nvidia_smi_total_bytes or self.gpu.total_memory_bytes) - (
            self.gpu.total_memory_bytes
        )
        if self.mig is None:
            card = NvmlDevice(
                self.name,
                f"GPU-{self.uuid}",
                self.total_bytes + driver_reserve_bytes,
                self.free_bytes,
            )
            return SimulatedNvml(
                card,
                mig_capable=self.gpu.name in MIG_CAPABLE,
                state=self._nvml_state,
            )
        # The card in MIG mode: its other slices idle; this process's slice as its MIG device.
        others_bytes = self.gpu.total_memory_bytes - self.total_bytes
        card = NvmlDevice(
            self.gpu.nvidia_smi_name,
            f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, self.gpu.nvidia_smi_name)}",
            self.gpu.total_memory_bytes + driver_reserve_bytes,
            lambda: self.free_bytes() + others_bytes,
        )
        slice_device = NvmlDevice(
            self.name, f"MIG-{self.uuid}", self.total_bytes, self.free_bytes, mig=True
        )
        return SimulatedNvml(card, mig_device=slice_device, state=self._nvml_state)

    # -- the device's memory ----------------------------------------------------------------

    @property
    def allocator_config(self) -> AllocatorConfig:
        """The caching allocator's settings in force (read from `environ` at initialization)."""
        return self._allocator.config

    @property
    def outside_allocator_bytes(self) -> int:
        """What CUDA holds outside the caching allocator: context, kernels, handles."""
        return self.context_bytes + self.kernel_bytes + self.handle_bytes

    def free_bytes(self) -> int:
        """What `cudaMemGetInfo` reports free: nobody holds it, this process's cache included."""
        used_bytes = (
            self.outside_allocator_bytes
            + self.other_processes_bytes
            + self._allocator.stats.reserved_bytes
        )
        return self.total_bytes - used_bytes

    def _allocator_capacity(self) -> int:
        return self.total_bytes - self.outside_allocator_bytes - self.other_processes_bytes

    def _check_index(self, index: int) -> None:
        if index != 0:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of 1)")

    def _take_outside(self, size_bytes: int, failure: str) -> None:
        """Take memory outside the allocator (cudaMalloc by the driver or a library): it fails
        with `failure` when free memory is short, the allocator's cache included, which CUDA
        cannot reclaim."""
        if size_bytes > self.free_bytes():
            raise RuntimeError(failure)
        self._allocator.capacity_bytes -= size_bytes

    def _create_context(self) -> None:
        if self.context_bytes == 0:
            self._take_outside(self.bare_context_bytes, CUDA_OUT_OF_MEMORY)
            self.context_bytes = self.bare_context_bytes

    def _before_op(self, name: str, args: tuple[Any, ...]) -> None:
        """What CUDA does before an op's kernel runs: context, library handles, kernel load."""
        self._create_context()
        if name in MATMUL_OPS:
            self._create_handle("cublas", CUBLAS_ALLOC_FAILED)
        elif name in CONVOLUTION_OPS:
            self._create_handle("cudnn", CUDNN_INTERNAL_ERROR)
            elements = max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)
            if elements > self.cudnn_max_elements:
                raise RuntimeError(CUDNN_NOT_SUPPORTED)
        if name not in self._loaded_ops:
            size_bytes = min(KERNEL_MODULE_BYTES, STEP_KERNELS_BYTES - self.kernel_bytes)
            self._take_outside(size_bytes, CUDA_OUT_OF_MEMORY)
            self.kernel_bytes += size_bytes
            self._loaded_ops.add(name)

    def _create_handle(self, library: str, failure: str) -> None:
        # Handles are per thread: forward and the optimizer run on the caller's, backward on the
        # autograd engine's device thread (which on the CPU is the caller's too, hence the test).
        key = (library, torch._C._current_graph_task_id() != -1)
        if key in self._handles:
            return
        self._take_outside(HANDLE_BYTES, failure)
        self.handle_bytes += HANDLE_BYTES
        self._handles.add(key)
        if library == "cublas":
            # torch allocates the workspaces through the caching allocator and keeps them
            # (torch's cuBLAS handle pool): allocated in every step from now on.
            self._workspaces += [self._malloc(size) for size in self.blas_workspace_sizes]

    def _malloc(self, size_bytes: int) -> BlockId:
        before = self._allocator.stats
        try:
            block = self._allocator.malloc(size_bytes)
        except AllocatorOutOfMemory as error:
            raise torch.OutOfMemoryError(self._out_of_memory_message(error)) from None
        after = self._allocator.stats
        # A new segment, or pages mapped into an expandable one: memory taken from the device.
        if after.reserved_bytes > before.reserved_bytes:
            self.device_mallocs += 1
        return block

    def _out_of_memory_message(self, error: AllocatorOutOfMemory) -> str:
        # The figures torch's message gives (the caching allocator's malloc).
        unallocated = error.reserved_bytes - error.allocated_bytes
        return (
            f"CUDA out of memory (simulated). Tried to allocate "
            f"{error.allocation_bytes / _MiB:.2f} MiB. GPU 0 has a total capacity of "
            f"{self.total_bytes / _MiB:.2f} MiB of which {self.free_bytes() / _MiB:.2f} MiB is "
            f"free. Of the allocated memory {error.allocated_bytes / _MiB:.2f} MiB is allocated "
            f"by PyTorch, and {unallocated / _MiB:.2f} MiB is reserved by PyTorch but unallocated."
        )

    def _place(self, out: object) -> None:
        """Put the storages an op returned on the device: new ones are malloc'd, grown ones
        (resize_) re-malloc'd as the allocator does."""
        if isinstance(out, torch.Tensor):
            self._place_tensor(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._place(item)

    def _place_tensor(self, tensor: torch.Tensor) -> None:
        try:
            storage = local_tensor(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse and other storage-less layouts
        key = id(storage)
        nbytes = storage.nbytes()
        known = self._storages.get(key)
        if known is not None:
            if nbytes <= known.nbytes:
                return
            self._release(known)
        ref = _StorageBlock(storage, self._release)
        ref.key, ref.nbytes = key, nbytes
        ref.block = self._malloc(nbytes)
        self._storages[key] = ref

    def _release(self, ref: weakref.ref[Any]) -> None:
        # Runs when a storage on the device dies (or is resized), whenever that is.
        assert isinstance(ref, _StorageBlock)
        if self._storages.get(ref.key) is ref:
            del self._storages[ref.key]
            self._allocator.free(ref.block)


class _DeviceMemory(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every op as the simulated GPU would: CUDA's preparations first, then the op, then
    its new storages on the device."""

    def __init__(self, cuda: SimulatedCuda) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._cuda = cuda

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "profiler":  # record_function markers: no kernel, no memory
            return func(*args, **(kwargs or {}))
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            # A step traced on fake tensors (autotune.engine.fit_points) in the same process:
            # no storage, no kernel, nothing on the card.
            return func(*args, **(kwargs or {}))
        self._cuda._before_op(func.overloadpacket.__name__, args)
        out = func(*args, **(kwargs or {}))
        self._cuda._place(out)
        return out
