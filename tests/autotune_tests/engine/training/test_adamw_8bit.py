"""The 8-bit AdamW allowance: bitsandbytes' state sizes on whole parameters and torchao's on
FSDP2's shards (compared with torchao's own optimizer), an AdamW that still learns, and the same
peak on fake tensors as on the emulated GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotune.core.memory.optimizer_states import (
    BLOCK_ELEMENTS,
    MIN_8BIT_ELEMENTS,
    Library,
    state_bytes,
)
from autotune.core.schemas import Phase, Spec, TrainingSpec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.probe import probe_session
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.adamw_8bit import CHUNK_ELEMENTS, AdamW8bit, assumption
from autotune.engine.training.step import TrainingStep, accumulate_gradients
from autotune.engine.training.workload import build_hf_config

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
        assert _state_bytes(optimizer, param) == state_bytes(param.numel(), Library.BITSANDBYTES)
    weight, bias = model[0].weight, model[0].bias
    assert weight.numel() >= MIN_8BIT_ELEMENTS > bias.numel()
    assert optimizer.state[weight]["state1"].dtype == torch.uint8
    assert optimizer.state[weight]["absmax1"].numel() == -(-weight.numel() // BLOCK_ELEMENTS)
    assert optimizer.state[bias]["exp_avg"].dtype == torch.float32
    # A quarter of torch AdamW's 8 bytes per element, plus 8 bytes per block of 256.
    assert state_bytes(2**20, Library.BITSANDBYTES) == 2 * 2**20 + 8 * 2**20 // 256


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


@pytest.mark.e2e
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
    assert assumption(Library.BITSANDBYTES) in emulated.device_info.assumptions


# Issue 23's GQA Llama: a vocabulary of 3001 rows leaves 1501 on the first of 2 ranks, a shard
# that is no whole number of 256-element blocks.
GQA_LLAMA = {
    "model_type": "llama",
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 3001,
    "max_position_embeddings": 64,
}


def _storage_bytes(state: dict[str, object]) -> int:
    """The bytes a state's tensors hold, through torchao's 8-bit subclass (codes, scale, qmap);
    step counters (scalars) left out."""
    total = 0
    for value in state.values():
        if not isinstance(value, torch.Tensor) or value.numel() <= 1:
            continue
        if isinstance(value, DTensor):
            value = value.to_local()
        names = value.__tensor_flatten__()[0] if type(value) is not torch.Tensor else []
        parts = [getattr(value, name) for name in names] or [value]
        total += sum(part.numel() * part.element_size() for part in parts)
    return total


@pytest.mark.e2e  # torchao compiles its step for every shape of shard (a minute here)
def test_sharded_states_are_torchaos_own() -> None:
    """On FSDP2's shards the allowance keeps what torchao's AdamW8bit keeps, parameter by
    parameter: 8 bits on whole 256-element blocks, the parameter's dtype off them (the
    embeddings' 1501 x 192 shard) or under 4096 elements (the norms)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    training = TrainingSpec(seq_len=16, optimizer="adamw8bit", world_size=2, sharding="zero3")
    workload = build_hf_config(dict(GQA_LLAMA), training)
    try:
        step = TrainingStep(workload, training, torch.device("cpu"))
        step.run(2)
        params = dict(step.model.named_parameters())
        real = torchao_optim.AdamW8bit(list(params.values()), lr=1e-4)
        batch = workload.make_batch(2, torch.device("cpu"))
        accumulate_gradients(step.model, workload.loss_sum, workload.num_items, [batch])
        real.step()
        measured = {name: _storage_bytes(step.optimizer.state[p]) for name, p in params.items()}
        torchaos = {name: _storage_bytes(real.state[p]) for name, p in params.items()}
        assert measured == torchaos
        embeddings = params["model.embed_tokens.weight"]
        local = embeddings.to_local()  # type: ignore[attr-defined]
        assert local.shape == (1501, 192)
        assert measured["model.embed_tokens.weight"] == state_bytes(local.numel(), Library.TORCHAO)
        assert "torchao's AdamW8bit" in assumption(Library.TORCHAO)
        assert assumption(Library.TORCHAO) in step.assumptions
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.e2e
def test_sharded_8bit_probes_alike_on_the_emulated_gpu_and_in_estimates() -> None:
    """Issue 23: sharding propagation failed on the 3001-row shard, in both."""
    training = {
        "seq_len": 32,
        "optimizer": "adamw8bit",
        "world_size": 2,
        "sharding": "zero3",
        "max_micro_batch": 16,
    }
    spec = Spec.model_validate({"model": {"hf_config": GQA_LLAMA}, "training": training})
    # At 40 MiB micro-batch 1 fits in the warm-up (no optimizer state yet in its forward and
    # backward) and runs out in every later step, which holds that state
    # (docs/design.md#the-layer-replay): both answer 0. At 64 MiB the sizes fit and fail by
    # size alone.
    capacity_bytes = 64 * 2**20
    emulated = probe_session(InProcessRunner(spec, EmulatedDevice(capacity_bytes)))
    estimated = probe_session(EstimateRunner(spec, capacity_bytes=capacity_bytes))
    maxima = [mode.max_micro_batch for mode in emulated.modes]
    assert maxima == [mode.max_micro_batch for mode in estimated.modes]
    assert all(maximum >= 1 for maximum in maxima), maxima


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_a_warm_up_that_fits_is_no_steady_step_that_fits(optimizer: str) -> None:
    """The warm-up makes the optimizer state in its optimizer step; every later step holds it
    through its forward and backward. On 40 MiB the zero3 rank's warm-up at micro-batch 1 fits,
    and the steady step at 1 runs out in the backward with the state held, with either
    optimizer (docs/design.md#the-layer-replay)."""
    training = {"seq_len": 32, "optimizer": optimizer, "world_size": 2, "sharding": "zero3"}
    spec = Spec.model_validate({"model": {"hf_config": GQA_LLAMA}, "training": training})
    runner = InProcessRunner(spec, EmulatedDevice(40 * 2**20))
    warm_up = runner.warm_up(checkpointing=False)
    assert warm_up.fits
    for _ in range(2):  # the same whatever ran before
        steady = runner.trial(1, checkpointing=False)
        assert steady.oom is not None
        assert steady.oom_phase == Phase.BACKWARD
        assert steady.oom.optimizer_state_bytes > 0
        assert steady.phase_peak_bytes[Phase.FORWARD] > warm_up.phase_peak_bytes[Phase.FORWARD]
