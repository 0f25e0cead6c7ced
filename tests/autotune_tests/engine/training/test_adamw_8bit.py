"""The 8-bit AdamW allowance: bitsandbytes' state sizes, an AdamW that still learns, and the
same peak on fake tensors as on the emulated GPU."""

from __future__ import annotations

import torch
from torch import nn

from autotune.core.schemas import Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.adamw_8bit import (
    ADAMW_8BIT_ASSUMPTION,
    BLOCK_ELEMENTS,
    CHUNK_ELEMENTS,
    MIN_8BIT_ELEMENTS,
    AdamW8bit,
    state_bytes,
)

HUGE_BYTES = 2**40


def _state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return sum(
        value.numel() * value.element_size()
        for value in optimizer.state[param].values()
        if isinstance(value, torch.Tensor)
    )


def test_states_are_bitsandbytes_sizes() -> None:
    # A weight over the 8-bit threshold whose size is no multiple of the block, a bias under it,
    # and one spanning two chunks.
    model = nn.Sequential(nn.Linear(65, 100), nn.Linear(100, CHUNK_ELEMENTS // 100 + 7))
    optimizer = AdamW8bit(model.parameters())
    model(torch.randn(3, 65)).sum().backward()
    optimizer.step()
    for param in model.parameters():
        assert _state_bytes(optimizer, param) == state_bytes(param.numel())
    weight, bias = model[0].weight, model[0].bias
    assert weight.numel() >= MIN_8BIT_ELEMENTS > bias.numel()
    assert optimizer.state[weight]["state1"].dtype == torch.uint8
    assert optimizer.state[weight]["absmax1"].numel() == -(-weight.numel() // BLOCK_ELEMENTS)
    assert optimizer.state[bias]["exp_avg"].dtype == torch.float32
    # A quarter of torch AdamW's 8 bytes per element, plus 8 bytes per block of 256.
    assert state_bytes(2**20) == 2 * 2**20 + 8 * 2**20 // 256


def test_it_follows_adamw_and_learns() -> None:
    torch.manual_seed(0)
    target = torch.randn(64, 96)
    inputs = torch.randn(256, 64)
    reference = nn.Linear(64, 96, bias=False)
    quantised = nn.Linear(64, 96, bias=False)
    quantised.load_state_dict(reference.state_dict())
    optimizers = (
        torch.optim.AdamW(reference.parameters(), lr=1e-2),
        AdamW8bit(quantised.parameters(), lr=1e-2),
    )
    losses: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(60):
        for index, (model, optimizer) in enumerate(
            zip((reference, quantised), optimizers, strict=True)
        ):
            loss = (model(inputs) - inputs @ target).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[index].append(float(loss.detach()))
    # The first step is exact (the states start at zero); later ones carry 8-bit rounding.
    assert losses[1][1] == losses[0][1]
    assert losses[1][-1] < 0.4 * losses[1][0]
    assert abs(losses[1][-1] - losses[0][-1]) < 0.05 * losses[0][-1]


def test_the_estimate_traces_the_same_peaks_as_the_emulated_gpu() -> None:
    spec = Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {
                "seq_len": 32,
                "precision": "bf16",
                "weights": "bf16",
                "optimizer": "adamw8bit",
            },
        }
    )
    estimate = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    emulated = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))
    for checkpointing in (False, True):
        a = estimate.trial(3, checkpointing=checkpointing)
        b = emulated.trial(3, checkpointing=checkpointing)
        # Only the first and last chunk of a parameter are traced: the peaks are the same, the
        # per-op series shorter.
        assert (a.peak_bytes, a.peak_allocated_bytes, a.phase_peak_bytes) == (
            b.peak_bytes,
            b.peak_allocated_bytes,
            b.phase_peak_bytes,
        )
    assert ADAMW_8BIT_ASSUMPTION in emulated.device_info.assumptions
