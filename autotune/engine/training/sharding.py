"""Sharded data parallel: one rank of ZeRO-1/2/3 or hybrid sharding, run by torch's own
implementations, in one process over a fake process group (docs/design.md#sharded-data-parallel)
or, in a launched job, over its real one.

A fake process group (torch's `FakeProcessGroup`, backend "fake") pretends to be `world_size`
ranks in one process: collectives return at once with their output buffers allocated but not
filled. So what one rank allocates, torch's FSDP2 and `ZeroRedundancyOptimizer` allocate here
exactly as on a GPU box: the rank's shards of the parameters, gradients and optimizer states,
each block's all-gathered parameters while it runs (and the next one's, prefetched), the
reduce-scatter buffers of its gradients. The values are not a real run's (the other ranks'
shards are never sent), which memory and time do not depend on.

* zero1: DDP (`autotune.engine.training.data_parallel`) with `ZeroRedundancyOptimizer`: every
  rank keeps all parameters and gradients, and the optimizer states of its partition of the
  parameters.
* zero2: FSDP2 `fully_shard(reshard_after_forward=False)`: parameters stay gathered from a
  block's forward to its backward (torch's "similar to ZeRO-2"), gradients and optimizer states
  sharded.
* zero3: FSDP2 `fully_shard` (full shard): every block's parameters are gathered for its
  forward and again for its backward, and freed after each.
* hybrid: zero3 within groups of `shard_group_size` ranks, replicated across groups (HSDP, a
  2-D device mesh).

FSDP2's units are the model's blocks (the entries of its largest `nn.ModuleList`, the layers
checkpointing wraps) and the root (embeddings, head, norms). Gradients are reduce-scattered after
every micro-batch and accumulate sharded (DeepSpeed's behaviour; FSDP's `no_sync` would keep a
whole model of unsharded gradients).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import _disable_current_modes

from autotune.core.parallel.layouts import (
    ModelParameters,
    ParameterShape,
    ShardUnit,
    gathers_in_16_bits,
)
from autotune.core.schemas import Precision, Sharding, TrainingSpec

_FAKE_BACKEND = "fake"
_COMPUTE_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def process_group(world_size: int, rank: int = 0) -> None:
    """Make sure there is a default process group of `world_size` ranks: a launched job's real
    one as it is, else a fake one in which this process is rank `rank`.

    Raises:
        RuntimeError: a real process group of another size is initialised.
    """
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != _FAKE_BACKEND:
            if dist.get_world_size() != world_size:
                raise RuntimeError(
                    f"training.world_size is {world_size}, but this process belongs to a "
                    f"{dist.get_backend()} process group of {dist.get_world_size()} ranks"
                )
            return
        if dist.get_world_size() == world_size and dist.get_rank() == rank:
            return
        dist.destroy_process_group()
    dist.init_process_group(_FAKE_BACKEND, rank=rank, world_size=world_size, store=FakeStore())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the entries of its largest `nn.ModuleList` (none: no blocks)."""
    lists = [list(m) for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=len) if lists else []


def _shape(param: torch.Tensor) -> ParameterShape:
    # A DTensor's shape and numel are its global ones: what FSDP2 gathers.
    return ParameterShape(
        dim0=param.shape[0] if param.dim() else 1,
        numel=param.numel(),
        element_size=param.element_size(),
        trainable=param.requires_grad,
    )


def model_parameters(model: nn.Module) -> ModelParameters:
    """`model`'s parameters as FSDP2's units hold them (`shard_model`: one per block, then the
    root with the rest) and its buffers' bytes, for `autotune.core.parallel.layouts`; the same
    whether the model is sharded yet or not."""
    in_blocks: set[int] = set()
    units = []
    for block in blocks(model):
        params = [p for p in block.parameters() if id(p) not in in_blocks]
        in_blocks.update(id(p) for p in params)
        units.append(ShardUnit(tuple(_shape(p) for p in params)))
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    units.append(ShardUnit(tuple(_shape(p) for p in root)))
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelParameters(units=tuple(units), buffer_bytes=buffer_bytes)


def shard_model(model: nn.Module, training: TrainingSpec, device: torch.device) -> nn.Module:
    """`model` wrapped in place by FSDP2 as `training.sharding` says (zero2, zero3, hybrid),
    over a fake process group of `training.world_size` ranks (this process is rank 0, whose
    shards are the largest: FSDP2 pads the others to its size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharding, world_size = training.sharding, training.world_size
    shape: tuple[int, ...] = (world_size,)
    names: tuple[str, ...] | None = None
    if sharding is Sharding.HYBRID:
        assert training.shard_group_size is not None  # the spec checked it
        shape = (world_size // training.shard_group_size, training.shard_group_size)
        names = ("replicate", "shard")
    # Host bookkeeping (the mesh's rank table), outside any mode counting a device or faking it.
    with unset_fake_temporarily(), _disable_current_modes():
        process_group(world_size)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": sharding is not Sharding.ZERO2,
        "mp_policy": mixed_precision(training),
    }
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def initialise(model: nn.Module) -> None:
    """Runs FSDP2's lazy initialisation of `model` (wrapped by `shard_model`) now, as its first
    forward would: the root's state, and each unit's gathered-parameter buffers, made by one
    unshard and freed by a reshard.

    Why before the first step, on an emulated or estimated rank: FSDP2 makes a unit's buffers
    at its first all-gather (one `empty` per parameter, and views of them), later ones resize
    the same buffers' storage back. The bytes and their order are the same either way, but
    the ops are not, so a step's per-op series would depend on how far the steps before it
    ran: after a warm-up that ran out in block k's forward, the next step would initialise the
    blocks after k and no others. A rank whose every unit is initialised before its first step
    runs the same ops in every step, whatever ran before, at any depth
    (docs/design.md#the-layer-replay). Outside any tracker the buffers are counted nowhere; on
    a real GPU they would stay in the caching allocator's cache, so it is not done there."""
    state = model._get_fsdp_state()  # type: ignore[operator]
    state._lazy_init()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def mixed_precision(training: TrainingSpec) -> Any:
    """FSDP2's mixed precision for the spec: with fp32 master weights under bf16/fp16 autocast,
    parameters gathered in the autocast dtype and gradients reduced in fp32 (torch's
    `MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`); else none.

    Why not fp32 gathers under autocast alone: autocast caches its cast of every leaf weight
    until the forward's autocast region exits, and FSDP2's gathered parameters are leaves, so
    a rank would hold a 16-bit copy of every block's weights, unsharded, at the end of the
    forward (2 bytes per parameter of the whole model, whatever the number of ranks: an 8B
    model's 15 GiB), and without checkpointing autograd saves those copies for backward too.
    FSDP2's policy gathers the 16-bit weights themselves, which FSDP2 frees after each block
    (DeepSpeed's bf16 ZeRO-3 likewise gathers 16-bit weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not gathers_in_16_bits(training):
        return MixedPrecisionPolicy()
    dtype = _COMPUTE_DTYPES[training.precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def zero1_optimizer(
    params: list[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """torch's ZeRO-1 over a fake process group of the spec's ranks, as the rank whose
    partition of the parameters is the largest (it partitions whole parameters greedily)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    world_size = dist.get_world_size()
    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
    partition_bytes = [
        sum(p.numel() * p.element_size() for group in groups for p in group["params"])
        for groups in optimizer._partition_parameters()  # type: ignore[attr-defined]
    ]
    heaviest = max(range(world_size), key=lambda rank: partition_bytes[rank])
    if heaviest != dist.get_rank() and dist.get_backend() == _FAKE_BACKEND:
        process_group(world_size, heaviest)
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
    return optimizer


def assumption(training: TrainingSpec) -> str:
    """What a sharded trial counts, as `DeviceInfo.assumptions` states it."""
    how = {
        Sharding.ZERO1: "torch DDP with ZeroRedundancyOptimizer (the rank with the largest "
        "partition of the optimizer states)",
        Sharding.ZERO2: "torch FSDP2 without resharding after forward (ZeRO-2: parameters "
        "gathered from forward to backward)",
        Sharding.ZERO3: "torch FSDP2 full shard, one unit per block and the root",
        Sharding.HYBRID: f"torch FSDP2 hybrid shard (groups of {training.shard_group_size})",
    }[training.sharding]
    if training.sharding is not Sharding.ZERO1 and gathers_in_16_bits(training):
        how += f", weights gathered in {training.precision} and gradients reduced in fp32"
    return (
        f"sharding {training.sharding}, {training.world_size} ranks: {how}, measured on one "
        "rank over a fake process group; gradients reduce-scattered every micro-batch; NCCL's own "
        "buffers are not tensors of the step"
    )
