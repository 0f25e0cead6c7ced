"""Block activation checkpointing for any `nn.Module` whose body is a list of blocks.

    model = MyModel()                                   # model.blocks: an nn.ModuleList
    set_checkpointing = checkpoint_blocks(model.blocks)
    set_checkpointing(True)   # from now on, in training mode, each block recomputes on backward

This is what a factory passes as `Workload.set_checkpointing` (see
`autotune.engine.training.workload`), and what the built-in models use
(`autotune.engine.training.zoo`). Each block's `forward` is replaced, on that instance only, by one
that runs the class's `forward` under `torch.utils.checkpoint.checkpoint` while checkpointing is on
and the block is training: the block keeps only its inputs for backward and recomputes its
activations then. The model's parameters, state dict and structure do not change. Non-reentrant
checkpointing (`use_reentrant=False`) is the one PyTorch recommends and the one transformers and
Lightning use; it works when the input does not require grad, and with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from torch import nn
from torch.utils.checkpoint import checkpoint


class PartialCheckpointing(Protocol):
    """Checkpointing of only the first k of a model's blocks, what
    `Workload.partial_checkpointing` offers when the model can
    (docs/design.md#partial-checkpointing)."""

    @property
    def num_blocks(self) -> int: ...

    def limit(self, count: int | None) -> None:
        """While checkpointing is on, checkpoint blocks 0..count-1 only; None: all."""
        ...


class BlockCheckpointing:
    """The switch `checkpoint_blocks` returns: call it with True or False. It also checkpoints
    only the first k blocks when asked (`limit`), a `PartialCheckpointing`."""

    def __init__(self, blocks: Iterable[nn.Module]) -> None:
        self.enabled = False
        self.count: int | None = None
        self.blocks = list(blocks)
        if not self.blocks:
            raise ValueError("checkpoint_blocks: no blocks given")
        for block in self.blocks:
            if not isinstance(block, nn.Module):
                raise TypeError(f"checkpoint_blocks: {type(block).__name__} is not an nn.Module")
            if "forward" in vars(block):
                raise ValueError(
                    f"checkpoint_blocks: this {type(block).__name__}'s forward is already "
                    "replaced (checkpoint_blocks called twice on it?)"
                )
        for index, block in enumerate(self.blocks):
            # An instance attribute, so nn.Module.__call__ (hooks included) calls it.
            block.forward = _CheckpointedForward(block, self, index)

    def __call__(self, enabled: bool) -> None:
        self.enabled = enabled

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def limit(self, count: int | None) -> None:
        self.count = count


class _CheckpointedForward:
    """A block's forward, checkpointed while its switch is on. A class rather than a closure
    so that `copy.deepcopy` and pickling of the model carry it along."""

    def __init__(self, block: nn.Module, switch: BlockCheckpointing, index: int) -> None:
        self.block = block
        self.switch = switch
        self.index = index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.block).forward.__get__(self.block)
        count = self.switch.count
        if self.switch.enabled and self.block.training and (count is None or self.index < count):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> BlockCheckpointing:
    """Make each of `blocks` checkpointable; returns the `set_checkpointing(enabled)` switch,
    off at first.

    Args:
        blocks: the model's repeated blocks, e.g. `model.layers` (an `nn.ModuleList`). Pick
            blocks whose activations dominate and whose inputs are small: transformer layers,
            residual stages. Each block's output must be a tensor or a tuple of tensors.

    Raises:
        ValueError: no blocks, or a block already made checkpointable.
        TypeError: an entry is not an `nn.Module`.
    """
    return BlockCheckpointing(blocks)
