"""Small simulated GPUs for the CUDA-device tests: catalogue cards shrunk so that a tiny model
on the CPU reaches their limit, with the card's identity, compute capability and MIG support."""

from __future__ import annotations

from dataclasses import replace

from autotune.core.gpus.catalogue import Gpu, find_gpu

MiB = 2**20
# Two SMs: a context of 212 MiB (208 MiB + 2 x 2048 threads x 1 KiB of stacks).
SMALL_SMS = 2


def small_gpu(name: str = "A100 80GB", total_mib: int = 512) -> Gpu:
    """`name` from the catalogue with `total_mib` of memory as CUDA reports it (nvidia-smi's
    total 64 MiB more: the driver's reserve) and two SMs."""
    return replace(
        find_gpu(name),
        total_memory_bytes=total_mib * MiB,
        nvidia_smi_total_bytes=(total_mib + 64) * MiB,
        sm_count=SMALL_SMS,
    )
