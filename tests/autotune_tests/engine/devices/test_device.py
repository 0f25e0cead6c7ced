"""The device layer on the CPU: emulated trials, OOM as a value, other errors untouched, a real
CPU allocator failure in a child process, open_device, and the NVML inventory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from autotune.core.errors import DeviceError, SpecError
from autotune.core.gpus.catalogue import Gpu, find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.schemas import DeviceKind, Phase
from autotune.engine.devices.cuda_device import CudaDevice
from autotune.engine.devices.device import EmulatedDevice, open_device
from autotune.engine.devices.nvml import GpuInfo, format_cuda_version, read_gpus
from autotune.engine.emulation.tracker import resident_tensors

MiB = 2**20
REPO = Path(__file__).resolve().parents[3]


class MlpTrainer:
    """A small MLP with SGD-momentum in steady state."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.step_fn(8)()

    def step_fn(self, micro_batch: int) -> Callable[[], None]:
        def step() -> None:
            x = torch.randn(micro_batch, 64)
            y = torch.randint(0, 10, (micro_batch,))
            nn.functional.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return step

    def resident(self) -> list[torch.Tensor]:
        return resident_tensors(self.model, self.optimizer)


@pytest.fixture
def trainer() -> MlpTrainer:
    return MlpTrainer()


def test_emulated_trial_that_fits(trainer: MlpTrainer) -> None:
    device = EmulatedDevice(64 * MiB)
    outcome = device.run_trial(trainer.step_fn(32), micro_batch=32, resident=trainer.resident())
    assert outcome.fits
    assert outcome.oom_phase is None
    assert set(outcome.phase_peak_bytes) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    # Live tensor bytes <= allocated blocks <= reserved segments, as torch.cuda reports them.
    assert outcome.peak_allocated_bytes is not None
    assert max(outcome.phase_peak_bytes.values()) <= outcome.peak_allocated_bytes
    assert outcome.peak_allocated_bytes <= outcome.peak_bytes
    assert outcome.num_alloc_retries == 0
    params_bytes = sum(p.numel() * 4 for p in trainer.model.parameters())
    # Parameters and momentum are resident; the step adds activations and gradients on top.
    assert 2 * params_bytes < outcome.peak_bytes < 64 * MiB
    assert outcome.series is None


def test_emulated_trial_that_does_not_fit_then_recovers(trainer: MlpTrainer) -> None:
    roomy = EmulatedDevice(64 * MiB)
    clean = roomy.run_trial(trainer.step_fn(512), micro_batch=512, resident=trainer.resident())
    assert clean.peak_allocated_bytes is not None
    # Below the allocated peak no allocator can hold the step.
    capacity_bytes = clean.peak_allocated_bytes - 4096
    tight = EmulatedDevice(capacity_bytes)
    outcome = tight.run_trial(trainer.step_fn(512), micro_batch=512, resident=trainer.resident())
    assert not outcome.fits
    assert outcome.oom_phase in (Phase.FORWARD, Phase.BACKWARD)
    assert outcome.peak_bytes <= capacity_bytes
    assert outcome.series is None
    trainer.optimizer.zero_grad(set_to_none=True)
    again = roomy.run_trial(
        trainer.step_fn(512), micro_batch=512, resident=trainer.resident(), record_series=True
    )
    assert again.fits
    assert again.peak_bytes == clean.peak_bytes
    assert again.series is not None and max(again.series) == clean.peak_allocated_bytes


def test_emulated_device_info() -> None:
    info = EmulatedDevice(3 * 2**30).info
    assert info.kind is DeviceKind.EMULATED
    assert info.capacity_bytes == info.total_memory_bytes == 3 * 2**30
    assert info.torch_version == torch.__version__
    assert "3.00 GiB" in info.name
    assert EmulatedDevice(MiB).torch_device == torch.device("cpu")
    with pytest.raises(SpecError):
        EmulatedDevice(0)


def _card(total_bytes: int) -> Gpu:
    """A T4 with one SM and `total_bytes` of memory: a named GPU small enough to fill on a CPU."""
    return dataclasses.replace(find_gpu("T4"), total_memory_bytes=total_bytes, sm_count=1)


def test_a_named_gpu_holds_its_blas_workspaces_and_runs_out_at_total_less_context(
    trainer: MlpTrainer,
) -> None:
    clean = EmulatedDevice(64 * MiB).run_trial(
        trainer.step_fn(512), micro_batch=512, resident=trainer.resident()
    )
    assert clean.peak_allocated_bytes is not None
    reserve = budget_for(_card(1)).reserve
    inside_bytes, outside_bytes = reserve.blas_workspace_bytes, reserve.context_bytes
    roomy = EmulatedDevice(gpu=budget_for(_card(clean.peak_bytes + 64 * MiB + outside_bytes)))
    assert roomy.capacity_bytes == clean.peak_bytes + 64 * MiB
    held = roomy.run_trial(trainer.step_fn(512), micro_batch=512, resident=trainer.resident())
    # The workspaces are allocated in every step, as the allocator holds them on the card.
    assert held.fits and held.peak_allocated_bytes is not None
    assert held.peak_allocated_bytes == clean.peak_allocated_bytes + inside_bytes
    exact = EmulatedDevice(gpu=budget_for(_card(held.peak_bytes + outside_bytes)))
    assert exact.capacity_bytes == held.peak_bytes
    fits = exact.run_trial(trainer.step_fn(512), micro_batch=512, resident=trainer.resident())
    assert fits.fits
    short_total_bytes = held.peak_allocated_bytes - 512 + outside_bytes
    short = EmulatedDevice(gpu=budget_for(_card(short_total_bytes)))
    refused = short.run_trial(trainer.step_fn(512), micro_batch=512, resident=trainer.resident())
    assert not refused.fits
    trainer.optimizer.zero_grad(set_to_none=True)


def test_a_budget_that_is_not_the_catalogues_names_no_catalogue_gpu() -> None:
    """A device of the caller's own budget (a slice of a card: its own capacity) must not be
    taken for the catalogue card, whose capacity a result of that name is checked against."""
    named = EmulatedDevice(gpu=budget_for(find_gpu("T4")))
    assert named.info.gpu == "T4" and named.info.name == "emulated T4 on cpu"
    slice_ = EmulatedDevice(gpu=budget_for(_card(512 * MiB)))
    assert slice_.info.gpu is None
    assert slice_.info.name.startswith("emulated T4 slice (allocator ")
    assert slice_.info.capacity_bytes == slice_.capacity_bytes


def test_a_named_gpu_states_its_memory_reserve_and_assumptions() -> None:
    device = open_device("cpu", gpu="h100-80gb", world_size=8)
    info = device.info
    budget = budget_for(find_gpu("H100 80GB"), 8)
    assert info.kind is DeviceKind.EMULATED
    assert info.gpu == "H100 80GB"
    assert info.name == "emulated H100 80GB on cpu"
    assert info.total_memory_bytes == 85045477376
    assert info.capacity_bytes == budget.capacity_bytes
    assert info.reserve == budget.reserve and info.reserve.nccl_bytes > 0
    assert info.assumptions == list(budget.assumptions)
    # One rank of one is given more than one rank of eight (no NCCL buffers).
    alone = open_device("cpu", gpu="H100 80GB").info
    assert alone.capacity_bytes - info.capacity_bytes == budget.reserve.nccl_bytes
    assert EmulatedDevice(MiB).info.gpu is None and EmulatedDevice(MiB).info.assumptions == []


def test_open_device_refuses_a_gpu_name_it_cannot_emulate() -> None:
    with pytest.raises(SpecError, match="--gpu: unknown GPU 'H100 PCIe'; known: T4, "):
        open_device("cpu", gpu="H100 PCIe")
    with pytest.raises(SpecError, match="give --gpu or --memory"):
        open_device("cpu", 2**30, gpu="T4")
    with pytest.raises(SpecError, match="'cuda:0' is measured as it is"):
        open_device("cuda:0", gpu="T4")
    with pytest.raises(ValueError, match="exactly one of capacity_bytes and gpu"):
        EmulatedDevice(2**30, gpu=budget_for(find_gpu("T4")))


def test_a_value_error_in_the_step_propagates_unchanged(trainer: MlpTrainer) -> None:
    def step() -> None:
        trainer.step_fn(4)()
        raise ValueError("labels out of range: 12")

    with pytest.raises(ValueError, match=r"^labels out of range: 12$"):
        EmulatedDevice(64 * MiB).run_trial(step, micro_batch=1, resident=trainer.resident())


def test_a_runtime_error_that_is_not_oom_propagates(trainer: MlpTrainer) -> None:
    def step() -> None:
        trainer.model(torch.randn(4, 63))  # wrong input width: a real shape error

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught:
        EmulatedDevice(64 * MiB).run_trial(step, micro_batch=1, resident=trainer.resident())
    assert type(caught.value) is RuntimeError


_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from autotune.engine.devices.device import EmulatedDevice

    def address_space_bytes():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    torch.ones(8) @ torch.ones(8)  # start the intra-op threads before the limit
    limit = address_space_bytes() + 256 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    device = EmulatedDevice(2**40)  # the tracker never objects: only the real allocator can
    huge = device.run_trial(lambda: torch.empty(2**30), micro_batch=1, resident=[])
    small = device.run_trial(lambda: torch.ones(2**20).sum(), micro_batch=1, resident=[])
    print(json.dumps({
        "huge_fits": huge.fits, "huge_oom_phase": huge.oom_phase,
        "small_fits": small.fits, "small_allocated_bytes": small.peak_allocated_bytes,
    }))
    """
)


@pytest.mark.e2e
def test_a_real_cpu_allocator_failure_is_out_of_memory() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "huge_fits": False,
        "huge_oom_phase": "forward",
        "small_fits": True,
        "small_allocated_bytes": 4 * MiB + 512,  # the sum's scalar takes one block
    }


def test_open_device_cpu() -> None:
    device = open_device("cpu", 2 * 2**30)
    assert isinstance(device, EmulatedDevice)
    assert device.info.capacity_bytes == 2 * 2**30
    with pytest.raises(SpecError, match="--memory: required with the emulated cpu device"):
        open_device("cpu")
    with pytest.raises(SpecError, match="positive"):
        open_device("cpu", 0)
    with pytest.raises(SpecError, match="unknown device 'tpu'"):
        open_device("tpu", 2**30)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_open_device_cuda_without_cuda(name: str) -> None:
    with pytest.raises(DeviceError, match="CUDA is not available.*--device cpu --memory"):
        open_device(name)
    with pytest.raises(DeviceError):
        CudaDevice()


def test_format_cuda_version() -> None:
    assert format_cuda_version(12040) == "12.4"
    assert format_cuda_version(11080) == "11.8"
    assert format_cuda_version(13000) == "13.0"


def test_read_gpus_matches_what_nvml_can_see() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert read_gpus() == []  # this machine: NVMLError_LibraryNotFound
        return
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    gpus = read_gpus()
    assert [gpu.index for gpu in gpus] == list(range(count))
    for gpu in gpus:
        assert isinstance(gpu, GpuInfo)
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert 0 <= gpu.used_bytes <= gpu.total_memory_bytes


def test_inventory_imports_without_torch() -> None:
    code = "import sys, autotune.engine.devices.nvml; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_untracked_trials_are_for_timing_only(trainer: MlpTrainer) -> None:
    # Untracked, even a tiny capacity is not enforced: the caller must have checked the fit.
    tiny = EmulatedDevice(MiB // 4)
    assert not tiny.run_trial(
        trainer.step_fn(512), micro_batch=512, resident=trainer.resident()
    ).fits
    trainer.optimizer.zero_grad(set_to_none=True)
    outcome = tiny.run_trial(
        trainer.step_fn(512), micro_batch=512, resident=trainer.resident(), track=False
    )
    assert outcome.fits
    assert outcome.peak_bytes == 0
    assert outcome.phase_peak_bytes == {}


def test_untracked_trials_still_catch_only_out_of_memory(trainer: MlpTrainer) -> None:
    device = EmulatedDevice(64 * MiB)

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    outcome = device.run_trial(oom, micro_batch=1, resident=[], track=False)
    assert not outcome.fits
    assert outcome.oom_phase is Phase.FORWARD

    def bug() -> None:
        raise KeyError("input_ids")

    with pytest.raises(KeyError, match="input_ids"):
        device.run_trial(bug, micro_batch=1, resident=[], track=False)


# The caching allocator on the emulated GPU
# (docs/design.md#the-caching-allocator-on-the-emulated-gpu).


def _allocating(*sizes_mib: float, keep: bool) -> Callable[[], None]:
    """A step that allocates tensors of these sizes one after another, keeping each alive
    (`keep`) or dropping it before the next."""

    def step() -> None:
        kept = []
        for size in sizes_mib:
            tensor = torch.empty(int(size * MiB), dtype=torch.uint8)
            if keep:
                kept.append(tensor)
            del tensor  # else the name keeps it alive while the next one is allocated

    return step


def test_a_step_runs_out_where_its_reserved_memory_would_pass_the_capacity() -> None:
    # 1.5 MiB is a 1-10 MiB request: the allocator makes a 20 MiB segment for it
    # (get_allocation_size), so a 10 MiB card cannot hold it though its bytes would fit.
    step = _allocating(1.5, keep=True)
    live = EmulatedDevice(10 * MiB, model_allocator=False).run_trial(
        step, micro_batch=1, resident=[]
    )
    assert live.fits and live.peak_bytes == int(1.5 * MiB)
    reserved = EmulatedDevice(10 * MiB).run_trial(step, micro_batch=1, resident=[])
    assert not reserved.fits and reserved.oom_phase is Phase.FORWARD
    assert reserved.peak_bytes == 0
    roomy = EmulatedDevice(20 * MiB).run_trial(step, micro_batch=1, resident=[])
    assert roomy.fits
    assert (roomy.peak_bytes, roomy.peak_allocated_bytes) == (20 * MiB, int(1.5 * MiB))


def test_the_allocator_frees_its_cache_and_retries_before_running_out() -> None:
    # 12 MiB is freed and cached; 14 MiB finds no cached block and no room for a new segment
    # next to it, so the allocator returns the cached one and retries (malloc's last resort).
    step = _allocating(12, 14, keep=False)
    outcome = EmulatedDevice(16 * MiB).run_trial(step, micro_batch=1, resident=[])
    assert outcome.fits
    assert outcome.num_alloc_retries == 1
    assert outcome.peak_bytes == 14 * MiB
    both_live = EmulatedDevice(16 * MiB).run_trial(
        _allocating(12, 14, keep=True), micro_batch=1, resident=[]
    )
    assert not both_live.fits


def test_the_allocator_configuration_changes_what_is_reserved() -> None:
    step = _allocating(12, 12, keep=True)
    plain = EmulatedDevice(64 * MiB).run_trial(step, micro_batch=1, resident=[])
    expandable = EmulatedDevice(
        64 * MiB, allocator_config=parse_alloc_conf("expandable_segments:True")
    ).run_trial(step, micro_batch=1, resident=[])
    # Two 12 MiB segments, against whole 20 MiB pages of one expandable segment.
    assert plain.peak_bytes == 24 * MiB
    assert expandable.peak_bytes == 40 * MiB
    # The device states the settings it models (canonical; None for torch's defaults).
    assert EmulatedDevice(MiB).info.allocator_conf is None
    written = "roundup_power2_divisions:1,expandable_segments:True"
    configured = EmulatedDevice(MiB, allocator_config=parse_alloc_conf(written))
    assert configured.info.allocator_conf == "expandable_segments:True"


def test_residents_the_allocator_cannot_hold_are_an_out_of_memory_of_the_trial() -> None:
    weights = torch.empty(4 * MiB, dtype=torch.uint8)
    outcome = EmulatedDevice(2 * MiB).run_trial(
        _allocating(0.5, keep=True), micro_batch=1, resident=[weights]
    )
    assert not outcome.fits
    assert outcome.series is None
