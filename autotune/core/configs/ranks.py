"""How many ranks a converted file trains on, and how they share the training state.

A file says its layout (Axolotl's `deepspeed`/`fsdp_config`, a DeepSpeed JSON's zero stage, a
TrainingArguments file's `deepspeed`/`fsdp`) but rarely its ranks: those come from the launcher
(`torchrun --nproc-per-node`, `accelerate launch --num_processes`). `--world-size`, or `--nodes`
x `--gpus-per-node`, say them here (`RankOptions`); `--sharding` replaces the file's layout
(`auto`: the tuner chooses, and `--write` writes its choice back in the file's own keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.core.configs.conversion import refuse
from autotune.core.errors import SpecError
from autotune.core.schemas import Sharding

WORLD_SIZE_OPTION = "--world-size"
LAYOUT = "layout"  # what the notes name when the file sets no layout (DDP)
ONE_RANK_HINT = "the file does not say how many; --world-size or --nodes x --gpus-per-node"


@dataclass(frozen=True)
class RankOptions:
    """The command line's ranks and layout, for a file that cannot say them."""

    world_size: int | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    sharding: Sharding | None = None

    def given(self) -> list[str]:
        """The options given, as their flags."""
        flags = {
            WORLD_SIZE_OPTION: self.world_size,
            "--nodes": self.nodes,
            "--gpus-per-node": self.gpus_per_node,
            "--sharding": self.sharding,
        }
        return [flag for flag, value in flags.items() if value is not None]

    def ranks(self) -> int | None:
        """The world size the options say (None: they say none).

        Raises:
            SpecError: `--nodes` without `--gpus-per-node` or a world size they divide, or a
                world size that disagrees with nodes x GPUs per node.
        """
        per_node = self.gpus_per_node
        if per_node is not None:
            product = (self.nodes or 1) * per_node
            if self.world_size is not None and self.world_size != product:
                raise refuse(
                    WORLD_SIZE_OPTION,
                    f"{self.world_size}, but --nodes x --gpus-per-node is {self.nodes or 1} x "
                    f"{per_node} = {product}; give one of the two",
                )
            return product
        if self.nodes is not None and (self.world_size is None or self.world_size % self.nodes):
            raise refuse("--nodes", "needs --gpus-per-node (or a --world-size it divides)")
        return self.world_size

    def topology(self) -> dict[str, Any]:
        """`TrainingSpec` fields for the nodes, when given (the world size is set apart)."""
        fields: dict[str, Any] = {}
        if self.nodes is not None:
            fields["nodes"] = self.nodes
            fields["gpus_per_node"] = self.gpus_per_node or (self.ranks() or 1) // self.nodes
        elif self.gpus_per_node is not None:
            fields["gpus_per_node"] = self.gpus_per_node
        return fields


def rank_count(options: RankOptions, said: int | None, *, key: str, notes: list[str]) -> int:
    """The ranks: the options' or the file's (`said`, under `key`), which must agree; one,
    noted, when neither says.

    Raises:
        SpecError: the options and the file disagree, or the options contradict themselves.
    """
    given = options.ranks()
    if given is not None and said is not None and given != said:
        raise refuse(key, f"{said} ranks, but the options say {given}")
    ranks = given if given is not None else said
    if ranks is None:
        notes.append(f"ranks: 1 ({ONE_RANK_HINT})")
        return 1
    return ranks


def layout(
    options: RankOptions,
    file_layout: Sharding,
    world: int,
    *,
    key: str,
    notes: list[str],
    grouped: bool = False,
) -> Sharding:
    """The layout to measure: `--sharding`, else the file's; on one rank, none (noted).
    `grouped`: the file says its hybrid shard groups (else they are the nodes).

    Raises:
        SpecError: hybrid sharding without the nodes that make its groups.
    """
    if options.sharding is not None:
        if options.sharding is not file_layout:
            notes.append(f"{key}: {file_layout} replaced by --sharding {options.sharding}")
        return options.sharding
    if file_layout is not Sharding.NONE and world < 2:
        notes.append(f"{key}: {file_layout} on one rank shards nothing")
        return Sharding.NONE
    if file_layout is Sharding.HYBRID and options.nodes is None and not grouped:
        raise refuse(
            key,
            "hybrid sharding shards within each node: give --nodes and --gpus-per-node",
        )
    return file_layout


def refuse_for_a_spec(options: RankOptions) -> None:
    """Raises:
    SpecError: a rank option given with a spec, which says its ranks itself.
    """
    for flag in options.given():
        raise SpecError(f"{flag}: the spec says it (training.world_size / nodes / sharding)")
