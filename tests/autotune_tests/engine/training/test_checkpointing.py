"""`checkpoint_blocks`: any model's blocks checkpointable, same gradients, nothing else changed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autotune.engine.training.checkpointing import checkpoint_blocks


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_checkpointed_blocks_give_the_same_gradients_and_recompute() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    keys = list(model.state_dict())
    switch = checkpoint_blocks(model.blocks)
    x = torch.randn(4, 8)
    plain = _grads(model, x)
    calls: list[int] = []
    model.blocks[0][0].register_forward_hook(lambda *_: calls.append(1))
    switch(True)
    assert switch.enabled
    checkpointed = _grads(model, x)
    torch.testing.assert_close(checkpointed, plain)
    assert len(calls) == 2  # forward, and again during backward: recomputed, not stored
    assert list(model.state_dict()) == keys  # parameters and structure unchanged


def test_checkpointing_applies_only_in_training_mode() -> None:
    model = _Blocks()
    switch = checkpoint_blocks(model.blocks)
    switch(True)
    calls: list[int] = []
    model.blocks[1].register_forward_hook(lambda *_: calls.append(1))
    model.eval()
    _grads(model, torch.randn(2, 8))
    assert len(calls) == 1


def test_a_deep_copy_has_its_own_switch() -> None:
    model = _Blocks()
    switch = checkpoint_blocks(model.blocks)
    twin = copy.deepcopy(model)
    switch(True)
    x = torch.randn(2, 8)
    torch.testing.assert_close(twin(x), model(x))
    twin_switch = twin.blocks[0].forward.switch
    assert twin_switch is not switch and twin_switch.enabled is False
    assert twin.blocks[0].forward.block is twin.blocks[0]


@pytest.mark.parametrize(
    ("blocks", "error", "message"),
    [
        ([], ValueError, "no blocks given"),
        ([object()], TypeError, "is not an nn.Module"),
    ],
)
def test_bad_blocks_are_refused(blocks: list[object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        checkpoint_blocks(blocks)  # type: ignore[arg-type]


def test_blocks_cannot_be_wrapped_twice() -> None:
    model = _Blocks()
    checkpoint_blocks(model.blocks)
    with pytest.raises(ValueError, match="already replaced"):
        checkpoint_blocks(model.blocks)
