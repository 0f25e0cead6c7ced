"""Real gloo process groups for tests that spawn ranks.

A rank must not reach interpreter shutdown while its group's worker threads still hold work:
gloo's thread then frees a tensor that needs the GIL of a finalising interpreter and the rank
aborts ("terminate called without an active exception", about one run in three of the FSDP2
loop test before this). So every rank meets the others at a barrier, and the group is destroyed
only once nothing else holds it (models, optimizers and DeviceMeshes keep it alive): its
destructor then joins those threads before the process goes on to exit.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def run_gloo_rank(rank: int, body: Callable[..., None], workdir: str, *args: Any) -> None:
    """`body(rank, workdir, *args)` as rank `rank` of two gloo ranks rendezvousing in `workdir`;
    for `torch.multiprocessing.spawn(run_gloo_rank, args=(body, workdir, ...))`.

    The body's locals (and with them every object holding the group) are gone when it returns.
    """
    run_gloo_ranks(rank, 2, body, workdir, *args)


def run_gloo_ranks(
    rank: int, world_size: int, body: Callable[..., None], workdir: str, *args: Any
) -> None:
    """`run_gloo_rank` for `world_size` ranks: `torch.multiprocessing.spawn(run_gloo_ranks,
    args=(world_size, body, workdir, ...), nprocs=world_size)`."""
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size
    )
    try:
        body(rank, workdir, *args)
        gc.collect()  # FSDP and DDP modules sit in reference cycles
        # Only on success: a rank that failed must not wait for peers that will never come.
        dist.barrier()
    finally:
        dist.destroy_process_group()
