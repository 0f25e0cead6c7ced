"""The bytes `autotune.core.parallel.layouts` says each layout moves are the bytes torch's own
DDP, ZeroRedundancyOptimizer and FSDP2 issue, wrapped as the engine wraps them
(`autotune.engine.training.sharding`), on two and four real gloo ranks: every collective
reaching the dispatcher (`c10d` ops, the DDP reducer's included) is counted in one optimizer
step of three micro-steps after a warm-up step."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.parallel.collectives import Collective
from autotune.core.parallel.layouts import layout_transfers
from autotune.core.parallel.topology import topology_for
from autotune.core.schemas import TrainingSpec
from autotune.engine.training.data_parallel import trainable_parameters
from autotune.engine.training.sharding import model_parameters, shard_model, zero1_optimizer
from tests.autotune_tests.gloo import run_gloo_ranks

# Spawned ranks import torch afresh (about 5 s each on two loaded cores): four ranks are e2e.
pytestmark = pytest.mark.slow

MICRO_STEPS = 3

# The c10d op of each collective and which of its tensors is the whole buffer.
_OPS = {
    "allreduce_": (Collective.ALL_REDUCE, "inputs"),
    "broadcast_": (Collective.BROADCAST, "inputs"),
    "_allgather_base_": (Collective.ALL_GATHER, "output"),
    "_reduce_scatter_base_": (Collective.REDUCE_SCATTER, "input"),
}


class _CollectiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts each collective's buffer bytes by kind (floating-point tensors only: DDP's
    bucket-index broadcasts are bookkeeping, not training traffic)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bytes: dict[str, int] = defaultdict(int)
        self.count: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name in _OPS:
            kind, which = _OPS[name]
            if which == "output":
                tensors = [args[0]]
            elif which == "input":
                tensors = [args[1]]
            else:
                tensors = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            if all(t.is_floating_point() for t in tensors):
                self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
                self.count[kind] += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 9 rows: FSDP2 pads them to a multiple of the shard count.
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    """Blocks in a ModuleList (FSDP2's units), a frozen embedding and a trained head in the
    root, and a buffer (DDP broadcasts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(6, 5)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.scale.sum()


def _spec(sharding: str, world_size: int) -> TrainingSpec:
    group = {"shard_group_size": 2} if sharding == "hybrid" else {}
    return TrainingSpec(sharding=sharding, world_size=world_size, **group)  # type: ignore[arg-type]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, ddp: bool, micro: int) -> None:
    tokens = torch.randint(0, 11, (2, 4))
    for i in range(micro):
        # The engine's DDP synchronises the last micro-step only; FSDP2 reduces every one.
        quiet = model.no_sync() if ddp and i < micro - 1 else nullcontext()  # type: ignore[operator]
        with quiet:
            model(tokens).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _count(rank: int, workdir: str, layouts: list[str]) -> None:
    world_size = dist.get_world_size()
    found: dict[str, Any] = {}
    for sharding in layouts:
        torch.manual_seed(0)
        model: nn.Module = _Model()
        training = _spec(sharding, world_size)
        ddp = sharding in ("none", "zero1")
        if ddp:
            model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            model = shard_model(model, training, torch.device("cpu"))
        params = trainable_parameters(model)
        optimizer = (
            zero1_optimizer(params, torch.optim.SGD, lr=0.1)
            if sharding == "zero1"
            else torch.optim.SGD(params, lr=0.1)
        )
        _step(model, optimizer, ddp, 2)  # warm-up: DDP rebuilds its buckets, FSDP2 initialises
        counter = _CollectiveBytes()
        with counter:
            _step(model, optimizer, ddp, MICRO_STEPS)
        found[sharding] = {"bytes": dict(counter.bytes), "count": dict(counter.count)}
        del model, optimizer, params
    if rank == 0:
        Path(workdir, "found.json").write_text(json.dumps(found))


def _expected(sharding: str, world_size: int) -> dict[str, dict[str, int]]:
    training = _spec(sharding, world_size)
    topology = topology_for(training, find_gpu("H100 80GB"))
    expected: dict[str, dict[str, int]] = {"bytes": defaultdict(int), "count": defaultdict(int)}
    for transfer in layout_transfers(training, model_parameters(_Model()), topology):
        times = MICRO_STEPS if transfer.cadence == "micro_step" else 1
        expected["bytes"][transfer.collective] += transfer.size_bytes * times
        expected["count"][transfer.collective] += transfer.count * times
    return {key: dict(value) for key, value in expected.items()}


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.e2e)])
def issued(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, dict[str, Any]]]:
    world_size: int = request.param
    workdir = tmp_path_factory.mktemp(f"gloo{world_size}")
    layouts = ["none", "zero1", "zero2", "zero3"] + (["hybrid"] if world_size == 4 else [])
    mp.spawn(run_gloo_ranks, args=(world_size, _count, str(workdir), layouts), nprocs=world_size)
    yield world_size, json.loads((workdir / "found.json").read_text())


@pytest.mark.e2e
@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3", "hybrid"])
def test_each_collective_moves_the_bytes_torch_issues(
    issued: tuple[int, dict[str, Any]], sharding: str
) -> None:
    world_size, found = issued
    if sharding not in found:
        pytest.skip("hybrid needs two groups of two ranks")
    assert found[sharding] == _expected(sharding, world_size)
