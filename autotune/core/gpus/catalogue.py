"""The catalogue of named GPUs: memory as CUDA reports it on the card, compute capability,
memory bandwidth, dense peak throughput per dtype, the link between GPUs of one node and the
most GPUs a real box holds, each figure with its source.

Torch-free: the API validates GPU names against it, the emulated device takes its capacity from
it (with `autotune.core.gpus.cuda_reserve`), and a roofline estimate can take its peaks from it.
The figures, their sources and their spread are discussed in
docs/design.md#named-gpus-and-what-cuda-takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_MiB = 2**20
_GiB = 2**30
_TERA = 10**12
_GIGA = 10**9

Interconnect = Literal["nvlink", "pcie"]


@dataclass(frozen=True)
class IntraNodeLink:
    """How one GPU reaches the other GPUs of its node: NVLink (through NVSwitch on the 8- and
    16-GPU boards) or PCIe. `bandwidth_bytes_per_s` is the datasheet's per-GPU figure, both
    directions together, as NVIDIA prints it; a collective's bus bandwidth is per direction
    (`autotune.core.parallel.topology` halves it)."""

    kind: Interconnect
    generation: str  # "NVLink 4" or "PCIe 4.0 x16"
    bandwidth_bytes_per_s: float
    source: str


@dataclass(frozen=True)
class LargestBox:
    """The most GPUs of this card one real server holds (`training.gpus_per_node` above it is
    refused), and the server that holds them."""

    gpus: int
    source: str


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s per dtype (no structured sparsity), tensor cores where the card has
    them for that dtype, with fp32 accumulation for fp16/bf16. None: the card has no fast path
    for that dtype (a roofline then falls back to `fp32_per_s`)."""

    fp32_per_s: float
    tf32_per_s: float | None
    bf16_per_s: float | None
    fp16_per_s: float | None


@dataclass(frozen=True)
class Gpu:
    """One GPU model.

    `total_memory_bytes` is what CUDA reports as the card's total (`cudaMemGetInfo`,
    `torch.cuda.mem_get_info()[1]`, `get_device_properties().total_memory`): less than the
    marketing size and less than nvidia-smi's total, by what the driver reserves; it varies a
    little with the driver, see `memory_source`. `nvidia_smi_total_bytes` is nvidia-smi's total
    (NVML), for reference only.
    """

    name: str
    aliases: tuple[str, ...]
    nvidia_smi_name: str
    total_memory_bytes: int
    memory_source: str
    nvidia_smi_total_bytes: int | None
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bandwidth_bytes_per_s: float
    peak: PeakFlops
    link: IntraNodeLink
    largest_box: LargestBox
    datasheet: str

    @property
    def interconnect(self) -> Interconnect:
        return self.link.kind

    @property
    def generation(self) -> str:
        """The architecture, from the compute capability."""
        return _GENERATIONS[self.compute_capability][0]

    @property
    def max_threads_per_sm(self) -> int:
        """Resident threads per SM for the compute capability (CUDA programming guide,
        "Technical Specifications per Compute Capability")."""
        return _GENERATIONS[self.compute_capability][1]


_GENERATIONS = {
    (7, 0): ("Volta", 2048),
    (7, 5): ("Turing", 1024),
    (8, 0): ("Ampere (GA100)", 2048),
    (8, 6): ("Ampere (GA10x)", 1536),
    (8, 9): ("Ada Lovelace", 1536),
    (9, 0): ("Hopper", 2048),
}

_V100_PEAK = PeakFlops(15.7 * _TERA, None, None, 125 * _TERA)
_A100_PEAK = PeakFlops(19.5 * _TERA, 156 * _TERA, 312 * _TERA, 312 * _TERA)
_HOPPER_PEAK = PeakFlops(67 * _TERA, 494.5 * _TERA, 989.5 * _TERA, 989.5 * _TERA)
_V100_DATASHEET = (
    "NVIDIA V100 datasheet (SXM2): images.nvidia.com/content/technologies/volta/pdf/"
    "volta-v100-datasheet-update-us-1165301-r5.pdf"
)
_A100_DATASHEET = (
    "NVIDIA A100 datasheet (SXM): nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)


def _nvlink(generation: int, gb_per_s: float, source: str) -> IntraNodeLink:
    return IntraNodeLink("nvlink", f"NVLink {generation}", gb_per_s * _GIGA, source)


def _pcie(generation: str, gb_per_s: float, source: str) -> IntraNodeLink:
    return IntraNodeLink("pcie", f"PCIe {generation} x16", gb_per_s * _GIGA, source)


def _box(gpus: int, source: str) -> LargestBox:
    return LargestBox(gpus, source)


_V100_LINK = _nvlink(2, 300, "NVIDIA V100 datasheet, SXM2 column: NVLink 300 GB/s")
_A100_LINK = _nvlink(3, 600, "NVIDIA A100 datasheet, SXM column: NVLink 600 GB/s")
_A100_BOX = _box(
    16, "NVIDIA A100 datasheet, server options: HGX A100 with 4, 8 or 16 GPUs, DGX A100 with 8"
)
# Supermicro SYS-322GB-NR, a 3U PCIe server: 18 single-slot or 10 dual-slot GPUs (The Register,
# 'Supermicro crams 18 GPUs into a 3U box', October 2024, naming the L4 and the L40S for it).
_SINGLE_SLOT_BOX = _box(
    18, "Supermicro SYS-322GB-NR: 18 single-slot PCIe GPUs (The Register, October 2024)"
)
_DUAL_SLOT_BOX = _box(
    10, "Supermicro SYS-322GB-NR: 10 dual-slot PCIe GPUs (The Register, October 2024)"
)

GPUS: tuple[Gpu, ...] = (
    Gpu(
        name="T4",
        aliases=("Tesla T4", "NVIDIA T4", "T4 16GB", "t4-16gb"),
        nvidia_smi_name="Tesla T4",
        total_memory_bytes=15095 * _MiB,
        memory_source="deviceQuery on Colab, driver CUDA 12.4 "
        "(sylvia-ymlin/cuda-kernels-from-scratch README); torch's OOM message there says "
        "14.75 GiB (hpcaitech/Open-Sora#697)",
        nvidia_smi_total_bytes=15360 * _MiB,
        compute_capability=(7, 5),
        sm_count=40,
        memory_bandwidth_bytes_per_s=320 * _GIGA,
        peak=PeakFlops(8.1 * _TERA, None, None, 65 * _TERA),
        link=_pcie("3.0", 32, "T4 datasheet: PCIe Gen3 x16, interconnect bandwidth 32 GB/s"),
        largest_box=_box(
            20,
            "Supermicro's 20-slot PCIe 3.0 x16 T4 server shown at SC18 (AnandTech, 'Scaling "
            "Inference with NVIDIA's T4: A Supermicro Solution with 320 PCIe Lanes')",
        ),
        datasheet="NVIDIA T4 datasheet: nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
        "tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    ),
    Gpu(
        name="V100 16GB",
        aliases=("V100-SXM2-16GB", "Tesla V100-SXM2-16GB", "v100-16gb"),
        nvidia_smi_name="Tesla V100-SXM2-16GB",
        total_memory_bytes=16160 * _MiB,
        memory_source="torch get_device_properties total_memory=16160MB (torch 1.7-1.8, "
        "cu101; public logs); newer drivers print 16130MB",
        nvidia_smi_total_bytes=None,
        compute_capability=(7, 0),
        sm_count=80,
        memory_bandwidth_bytes_per_s=900 * _GIGA,
        peak=_V100_PEAK,
        link=_V100_LINK,
        largest_box=_box(
            8,
            "NVIDIA DGX-1 with V100: 8 SXM2 GPUs (the 16-GPU DGX-2 shipped 32 GB cards)",
        ),
        datasheet=_V100_DATASHEET,
    ),
    Gpu(
        name="V100 32GB",
        aliases=("V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "v100-32gb"),
        nvidia_smi_name="Tesla V100-SXM2-32GB",
        # torch prints the total rounded to 0.01 GiB: 31.74 GiB is 32,496-32,506 MiB.
        total_memory_bytes=32501 * _MiB,
        memory_source="torch OOM message '31.74 GiB total capacity' on 8x V100 32GB "
        "(haotian-liu/LLaVA#812; also liucongg/ChatGLM-Finetuning#73)",
        nvidia_smi_total_bytes=None,
        compute_capability=(7, 0),
        sm_count=80,
        memory_bandwidth_bytes_per_s=900 * _GIGA,
        peak=_V100_PEAK,
        link=_V100_LINK,
        largest_box=_box(16, "NVIDIA DGX-2 datasheet: 16 V100 32GB on NVSwitch"),
        datasheet=_V100_DATASHEET,
    ),
    Gpu(
        name="A10G",
        aliases=("NVIDIA A10G", "A10G 24GB", "a10g-24gb"),
        nvidia_smi_name="NVIDIA A10G",
        total_memory_bytes=22587 * _MiB,
        memory_source="torch get_device_properties total_memory=22587MB (torch >= 2.5, public "
        "printout); nvidia-smi 23028MiB with driver 535 (NVIDIA/DCGM#232)",
        nvidia_smi_total_bytes=23028 * _MiB,
        compute_capability=(8, 6),
        sm_count=80,
        memory_bandwidth_bytes_per_s=600 * _GIGA,
        peak=PeakFlops(35 * _TERA, 35 * _TERA, 70 * _TERA, 70 * _TERA),
        link=_pcie(
            "4.0",
            64,
            "NVIDIA A10 datasheet (the A10G is its AWS variant): PCIe Gen4 64 GB/s, no NVLink",
        ),
        largest_box=_box(8, "AWS EC2 G5 instance types: g5.48xlarge has 8 A10G"),
        datasheet="no NVIDIA datasheet (an AWS-only part): Baseten, 'NVIDIA A10 vs A10G for ML "
        "model inference' (baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference); the "
        "tensor figures are the least certain of the catalogue",
    ),
    Gpu(
        name="L4",
        aliases=("NVIDIA L4", "L4 24GB", "l4-24gb"),
        nvidia_smi_name="NVIDIA L4",
        total_memory_bytes=23583784960,
        memory_source="deviceQuery 22491 MBytes (23583784960 bytes), driver CUDA 12.2 "
        "(bottlerocket-os/bottlerocket-kernel-kit#139)",
        nvidia_smi_total_bytes=23034 * _MiB,
        compute_capability=(8, 9),
        sm_count=58,
        memory_bandwidth_bytes_per_s=300 * _GIGA,
        peak=PeakFlops(30.3 * _TERA, 60 * _TERA, 121 * _TERA, 121 * _TERA),
        link=_pcie("4.0", 64, "NVIDIA L4 datasheet: PCIe Gen4 x16 64 GB/s, no NVLink"),
        largest_box=_SINGLE_SLOT_BOX,
        datasheet="NVIDIA L4 datasheet (tensor figures given with sparsity, halved here): "
        "nvidia.com/en-us/data-center/l4/",
    ),
    Gpu(
        name="L40S",
        aliases=("NVIDIA L40S", "L40S 48GB", "l40s-48gb"),
        nvidia_smi_name="NVIDIA L40S",
        total_memory_bytes=47803596800,
        memory_source="deviceQuery 45589 MBytes (47803596800 bytes), driver CUDA 12.4 (public "
        "GPU spec note); torch prints total_memory=45589MB",
        nvidia_smi_total_bytes=46068 * _MiB,
        compute_capability=(8, 9),
        sm_count=142,
        memory_bandwidth_bytes_per_s=864 * _GIGA,
        peak=PeakFlops(91.6 * _TERA, 183 * _TERA, 362.05 * _TERA, 362.05 * _TERA),
        link=_pcie(
            "4.0",
            64,
            "NVIDIA L40S datasheet: PCIe Gen4 x16 64 GB/s bidirectional, no NVLink",
        ),
        largest_box=_DUAL_SLOT_BOX,
        datasheet="NVIDIA L40S datasheet: nvidia.com/en-us/data-center/l40s/",
    ),
    Gpu(
        name="RTX 3090",
        aliases=("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", "3090", "RTX 3090 24GB"),
        nvidia_smi_name="NVIDIA GeForce RTX 3090",
        total_memory_bytes=24268 * _MiB,
        memory_source="torch get_device_properties total_memory=24268MB (Hugging Face "
        "transformers DeepSpeed guide, en/deepspeed.md); nvidia-smi 24268MiB with driver 455 "
        "(pytorch/pytorch#54564)",
        nvidia_smi_total_bytes=24268 * _MiB,
        compute_capability=(8, 6),
        sm_count=82,
        memory_bandwidth_bytes_per_s=936 * _GIGA,
        peak=PeakFlops(35.6 * _TERA, 35.6 * _TERA, 71 * _TERA, 71 * _TERA),
        link=_pcie(
            "4.0",
            64,
            "GA102 whitepaper: PCIe 4.0 x16 (64 GB/s both directions); its NVLink bridge joins "
            "pairs only, so more than two cards talk over PCIe",
        ),
        largest_box=_DUAL_SLOT_BOX,
        datasheet="NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090 column (fp16 and "
        "bf16 with fp32 accumulate): nvidia.com/content/PDF/"
        "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf",
    ),
    Gpu(
        name="RTX 4090",
        aliases=("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", "4090", "RTX 4090 24GB"),
        nvidia_smi_name="NVIDIA GeForce RTX 4090",
        total_memory_bytes=24563 * _MiB,
        memory_source="CUDA.jl total 23.988 GiB (pc2/GPUInspector.jl#11); torch prints "
        "total_memory=24563MB; cards driving a display report 23.6-23.7 GiB",
        nvidia_smi_total_bytes=24564 * _MiB,
        compute_capability=(8, 9),
        sm_count=128,
        memory_bandwidth_bytes_per_s=1008 * _GIGA,
        peak=PeakFlops(82.6 * _TERA, 82.6 * _TERA, 165.2 * _TERA, 165.2 * _TERA),
        link=_pcie(
            "4.0",
            64,
            "Ada whitepaper: PCIe 4.0 x16 (64 GB/s both directions), no NVLink connector",
        ),
        largest_box=_DUAL_SLOT_BOX,
        datasheet="NVIDIA Ada GPU architecture whitepaper, RTX 4090 column (fp16 and bf16 with "
        "fp32 accumulate): images.nvidia.com/aem-dam/Solutions/geforce/ada/"
        "nvidia-ada-gpu-architecture.pdf",
    ),
    Gpu(
        name="A100 40GB",
        aliases=("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "a100-40gb"),
        nvidia_smi_name="NVIDIA A100-SXM4-40GB",
        total_memory_bytes=42298834944,
        memory_source="deviceQuery 40339 MBytes (42298834944 bytes), driver 535 / CUDA 12.2 "
        "(bottlerocket-os/bottlerocket#3873); older drivers report 40536 MiB",
        nvidia_smi_total_bytes=40960 * _MiB,
        compute_capability=(8, 0),
        sm_count=108,
        memory_bandwidth_bytes_per_s=1555 * _GIGA,
        peak=_A100_PEAK,
        link=_A100_LINK,
        largest_box=_A100_BOX,
        datasheet=_A100_DATASHEET,
    ),
    Gpu(
        name="A100 80GB",
        aliases=("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", "a100-80gb"),
        nvidia_smi_name="NVIDIA A100-SXM4-80GB",
        total_memory_bytes=81049 * _MiB,
        memory_source="mixbench 'Total global mem: 81049 MB' on A100 80GB PCIe, driver 545 "
        "(ekondis/mixbench#47); torch's OOM message says 79.14 GiB on an A100 80GB "
        "(lianqi1008/Control-GIC#6)",
        nvidia_smi_total_bytes=81920 * _MiB,
        compute_capability=(8, 0),
        sm_count=108,
        memory_bandwidth_bytes_per_s=2039 * _GIGA,
        peak=_A100_PEAK,
        link=_A100_LINK,
        largest_box=_A100_BOX,
        datasheet=_A100_DATASHEET,
    ),
    Gpu(
        name="H100 80GB",
        aliases=(
            "H100-SXM5-80GB",
            "NVIDIA H100 80GB HBM3",
            "H100 SXM",
            "H100 80GB HBM3",
            "h100-80gb",
        ),
        nvidia_smi_name="NVIDIA H100 80GB HBM3",
        total_memory_bytes=85045477376,
        memory_source="deviceQuery 81106 MBytes (85045477376 bytes), driver CUDA 12.7 "
        "(thamada/nvidia-smi, nvsim/H100SXMx8_deviceQuery.py); torch prints 81082-81090MB "
        "and OOM messages 79.11 GiB with other drivers (vllm-project/vllm#27508)",
        nvidia_smi_total_bytes=81559 * _MiB,
        compute_capability=(9, 0),
        sm_count=132,
        memory_bandwidth_bytes_per_s=3.35 * _TERA,
        peak=_HOPPER_PEAK,
        link=_nvlink(4, 900, "NVIDIA H100 datasheet, SXM column: NVLink 900 GB/s"),
        largest_box=_box(
            8,
            "NVIDIA H100 datasheet, server options: HGX H100 with 4 or 8 GPUs, DGX H100 with 8",
        ),
        datasheet="NVIDIA H100 datasheet, SXM column (tensor figures given with sparsity, "
        "halved here): resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
    ),
    Gpu(
        name="H200 141GB",
        aliases=("H200", "NVIDIA H200", "H200-SXM-141GB", "H200 SXM", "h200-141gb"),
        nvidia_smi_name="NVIDIA H200",
        total_memory_bytes=143156 * _MiB,
        memory_source="torch get_device_properties total_memory=143156MB (public printout in a "
        "Modal example); nvidia-smi 143771MiB (thundergolfer.com/blog/nvidia-gpu-memory-capacity)",
        nvidia_smi_total_bytes=143771 * _MiB,
        compute_capability=(9, 0),
        sm_count=132,
        memory_bandwidth_bytes_per_s=4.8 * _TERA,
        peak=_HOPPER_PEAK,
        link=_nvlink(4, 900, "NVIDIA H200 datasheet, SXM column: NVLink 900 GB/s"),
        largest_box=_box(8, "NVIDIA H200 datasheet, server options: HGX H200 with 4 or 8 GPUs"),
        datasheet="NVIDIA H200 datasheet, SXM column (tensor figures given with sparsity, "
        "halved here): nvidia.com/en-us/data-center/h200/",
    ),
)

_VENDOR_WORDS = re.compile(r"^(nvidia|tesla|geforce)")


def _key(text: str) -> str:
    """Case, spaces, hyphens and a leading vendor word do not matter: "h100-80gb",
    "H100 80GB" and "NVIDIA H100 80GB" are one key."""
    key = re.sub(r"[^0-9a-z]", "", text.casefold())
    while (stripped := _VENDOR_WORDS.sub("", key)) != key:
        key = stripped
    return key


def _index() -> dict[str, Gpu]:
    index: dict[str, Gpu] = {}
    for gpu in GPUS:
        for name in (gpu.name, gpu.nvidia_smi_name, *gpu.aliases):
            key = _key(name)
            if index.setdefault(key, gpu) is not gpu:
                raise AssertionError(f"GPU name {name!r} is ambiguous")
    return index


_BY_KEY = _index()
KNOWN_NAMES = ", ".join(gpu.name for gpu in GPUS)


class UnknownGpu(ValueError):
    """A GPU name the catalogue does not know; the message lists the names it knows."""


def find_gpu(name: str) -> Gpu:
    """The catalogue entry for a name or alias, e.g. "H100 80GB", "h100-80gb", "H100-SXM5-80GB"
    or nvidia-smi's "NVIDIA H100 80GB HBM3" (case, spaces and hyphens do not matter).

    Raises:
        UnknownGpu: no such GPU; the message lists the known names.
    """
    gpu = _BY_KEY.get(_key(name))
    if gpu is None:
        raise UnknownGpu(f"unknown GPU {name!r}; known: {KNOWN_NAMES}")
    return gpu
