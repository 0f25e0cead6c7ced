"""The named GPUs' catalogue: lookups by name and alias, one-line errors, and figures that are
consistent with each other and with how CUDA reports memory."""

from __future__ import annotations

import pytest

from autotune.core.gpus.catalogue import GPUS, KNOWN_NAMES, Gpu, UnknownGpu, find_gpu

MIB = 2**20

REQUIRED = (
    "T4",
    "V100 16GB",
    "V100 32GB",
    "A10G",
    "L4",
    "L40S",
    "RTX 3090",
    "RTX 4090",
    "A100 40GB",
    "A100 80GB",
    "H100 80GB",
    "H200 141GB",
)


def test_the_catalogue_has_every_gpu_the_issue_asks_for() -> None:
    assert tuple(gpu.name for gpu in GPUS) == REQUIRED


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("H100 80GB", "H100 80GB"),
        ("h100-80gb", "H100 80GB"),
        ("H100-SXM5-80GB", "H100 80GB"),
        ("NVIDIA H100 80GB HBM3", "H100 80GB"),  # nvidia-smi's name
        ("  h100_80GB ", "H100 80GB"),
        ("A100-SXM4-80GB", "A100 80GB"),
        ("a100 40gb", "A100 40GB"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-32GB", "V100 32GB"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("geforce rtx 3090", "RTX 3090"),
        ("nvidia a10g", "A10G"),
        ("NVIDIA H200", "H200 141GB"),
    ],
)
def test_names_and_aliases_are_found_ignoring_case_spaces_and_hyphens(
    text: str, name: str
) -> None:
    assert find_gpu(text).name == name


def test_every_name_alias_and_nvidia_smi_name_finds_its_own_gpu() -> None:
    for gpu in GPUS:
        for text in (gpu.name, gpu.nvidia_smi_name, *gpu.aliases):
            assert find_gpu(text) is gpu, text


@pytest.mark.parametrize("text", ["H100 PCIe", "H100", "V100", "A100", "B200", "", "80GB"])
def test_an_unknown_or_ambiguous_name_is_one_line_listing_the_known_names(text: str) -> None:
    with pytest.raises(UnknownGpu) as refused:
        find_gpu(text)
    message = str(refused.value)
    assert message == f"unknown GPU {text!r}; known: {KNOWN_NAMES}"
    assert "\n" not in message
    assert all(name in message for name in REQUIRED)


@pytest.mark.parametrize("gpu", GPUS, ids=lambda gpu: gpu.name)
def test_figures_are_consistent(gpu: Gpu) -> None:
    # CUDA reports less than nvidia-smi (the driver's reserve), never more.
    if gpu.nvidia_smi_total_bytes is not None:
        assert 0.97 * gpu.nvidia_smi_total_bytes <= gpu.total_memory_bytes
        assert gpu.total_memory_bytes <= gpu.nvidia_smi_total_bytes
    assert gpu.memory_source and gpu.datasheet
    assert gpu.sm_count > 0 and gpu.max_threads_per_sm in (1024, 1536, 2048)
    assert gpu.generation
    peak = gpu.peak
    # Tensor-core paths are at least as fast as plain fp32; tf32 at most half-precision's rate.
    for fast in (peak.tf32_per_s, peak.bf16_per_s, peak.fp16_per_s):
        assert fast is None or fast >= peak.fp32_per_s
    if peak.tf32_per_s is not None and peak.bf16_per_s is not None:
        assert peak.tf32_per_s <= peak.bf16_per_s
    # bf16 and tf32 tensor cores came with Ampere (compute capability 8.0).
    assert (peak.bf16_per_s is None) == (gpu.compute_capability < (8, 0))
    assert (peak.tf32_per_s is None) == (gpu.compute_capability < (8, 0))
    assert gpu.memory_bandwidth_bytes_per_s > 100e9


def test_memory_is_what_cuda_reports_not_the_marketing_size() -> None:
    # The issue's examples: nvidia-smi shows 81920 MiB on an A100 80GB and 81559 MiB on an
    # H100 80GB; CUDA hands a process less than either.
    assert find_gpu("A100 80GB").nvidia_smi_total_bytes == 81920 * MIB
    assert find_gpu("H100 80GB").nvidia_smi_total_bytes == 81559 * MIB
    assert find_gpu("H100 80GB").total_memory_bytes == 85045477376
    assert find_gpu("A100 40GB").total_memory_bytes == 42298834944
