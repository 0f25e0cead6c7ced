"""Workload factories for tests of the `factory` model source and of the training step.

Referenced from specs as "tests.autotune_tests.factories:<function>", so they are imported the
way a user's factory is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autotune.core.presets import DecoderPreset
from autotune.core.schemas import TrainingSpec
from autotune.engine.training.workload import (
    IGNORE_INDEX,
    Batch,
    Workload,
    causal_lm_loss_sum,
    count_label_tokens,
)
from autotune.engine.training.zoo import build_model

TINY_VOCAB = 64
# A transformers Llama small enough for a test (the `hf` extra builds it with random weights).
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}

TINY_GPT2 = DecoderPreset("gpt2", n_layer=2, n_head=2, d_model=32, vocab_size=64, max_seq_len=64)
TINY_LLAMA = DecoderPreset(
    "llama", n_layer=2, n_head=4, d_model=32, vocab_size=64, max_seq_len=64, n_kv_head=2,
    ffn_hidden=48,
)  # fmt: skip


def _lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    return causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])


def tiny_lm(training: TrainingSpec, preset: DecoderPreset = TINY_LLAMA) -> Workload:
    """A tiny Llama on random full-length token batches."""
    seq_len = training.seq_len or 16
    model = build_model(preset)

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        ids = torch.randint(0, preset.vocab_size, (micro_batch, seq_len), device=device)
        return {"input_ids": ids, "labels": ids}

    def set_checkpointing(enabled: bool) -> None:
        model.gradient_checkpointing = enabled

    return Workload(
        model=model,
        make_batch=make_batch,
        loss_sum=_lm_loss_sum,
        num_items=count_label_tokens,
        set_checkpointing=set_checkpointing,
        tokens_per_sample=seq_len,
    )


class PaddedSamples:
    """A fixed pool of variable-length token sequences, handed out in order. Each micro-batch is
    right-padded to its own longest sequence, with labels -100 on the padding, as a collator
    does. Two instances with the same seed hand out the same samples."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.samples = [torch.randint(0, TINY_VOCAB, (n,), generator=generator) for n in lengths]
        self.cursor = 0

    def make_batch(self, micro_batch: int, device: torch.device) -> Batch:
        chosen = self.samples[self.cursor : self.cursor + micro_batch]
        assert len(chosen) == micro_batch, "the pool ran out of samples"
        self.cursor += micro_batch
        width = max(len(s) for s in chosen)
        ids = torch.zeros(micro_batch, width, dtype=torch.int64, device=device)
        labels = torch.full((micro_batch, width), IGNORE_INDEX, dtype=torch.int64, device=device)
        for row, sample in enumerate(chosen):
            ids[row, : len(sample)] = sample
            labels[row, : len(sample)] = sample
        return {"input_ids": ids, "labels": labels}


def padded_lm(
    lengths: list[int], preset: DecoderPreset = TINY_GPT2, seed: int = 0
) -> tuple[Workload, PaddedSamples]:
    """A tiny LM (same weights for the same seed) fed from a `PaddedSamples` pool."""
    torch.manual_seed(seed)
    model = build_model(preset)
    pool = PaddedSamples(lengths, seed)
    workload = Workload(
        model=model,
        make_batch=pool.make_batch,
        loss_sum=_lm_loss_sum,
        num_items=count_label_tokens,
        set_checkpointing=lambda enabled: setattr(model, "gradient_checkpointing", enabled),
    )
    return workload, pool


def tiny_classifier_without_checkpointing(training: TrainingSpec) -> Workload:
    """A fixed-shape classifier whose workload does not support checkpointing."""
    shape = training.input_shape or (8,)
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.Size(shape).numel()), 4))

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        return (
            torch.randn(micro_batch, *shape, device=device),
            torch.randint(0, 4, (micro_batch,), device=device),
        )

    def loss_sum(module: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(module(inputs), labels, reduction="sum")

    def num_items(batch: Batch) -> int:
        return int(batch[1].shape[0])

    return Workload(model, make_batch, loss_sum, num_items)


SWALLOWING_LAYERS = 400


def swallows_errors(training: TrainingSpec) -> Workload:
    """A build that catches every error while making its layers (as a library's best-effort
    initialisation may) and goes on: `SWALLOWING_LAYERS` layers, those that failed left out."""
    layers: list[nn.Module] = []
    for _ in range(SWALLOWING_LAYERS):
        try:
            layer = nn.Linear(4, 4)
            nn.init.normal_(layer.weight)
            layers.append(layer)
        except Exception:  # noqa: S112 - what such a build does, on purpose
            continue
    return _sum_of_squares(nn.Sequential(*layers), 4)


def returns_a_module(training: TrainingSpec) -> nn.Module:
    """Wrong: returns the bare model instead of a Workload."""
    return nn.Linear(4, 4)


def raises_inside(training: TrainingSpec) -> Workload:
    """Wrong: the user's code fails."""
    raise RuntimeError("the user's factory broke")


class _Elementwise(nn.Module):
    """Layers of elementwise scales: activations of `features` floats per sample and layer, no
    matmul, so memory grows fast with the batch at little compute."""

    def __init__(self, features: int, layers: int = 3) -> None:
        super().__init__()
        self.scales = nn.ParameterList(
            nn.Parameter(torch.full((features,), 0.5)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for scale in self.scales:
            x = torch.tanh(x * scale)
        return x


def elementwise(training: TrainingSpec) -> Workload:
    """Large activations, cheap steps: `training.input_shape` = (features,), 2^18 (1 MiB of
    fp32 a sample) by default. For allocator behaviour that needs large tensors."""
    features = training.input_shape[0] if training.input_shape else 2**18
    return _sum_of_squares(_Elementwise(features), features)


def _sum_of_squares(model: nn.Module, features: int) -> Workload:
    """`model` on random inputs of `features` floats a sample; the loss, its outputs' squares."""

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        return torch.randn(micro_batch, features, device=device)

    def loss_sum(module: nn.Module, batch: Batch) -> torch.Tensor:
        out: torch.Tensor = module(batch).square().sum()
        return out

    def num_items(batch: Batch) -> int:
        return int(batch.shape[0])

    return Workload(model, make_batch, loss_sum, num_items)


class _LinearStack(nn.Module):
    """`layers` square linear blocks (FSDP2's units: the entries of its ModuleList)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def _linear_stack(width: int, layers: int) -> Workload:
    return _sum_of_squares(_LinearStack(width, layers), width)


def linear_stack_4k(training: TrainingSpec) -> Workload:
    """Four 4096-wide linear blocks: 67 million parameters, which fit whole on a large card;
    for estimates (fake tensors) of data-parallel layouts."""
    return _linear_stack(4096, 4)


def linear_stack_32k_deep(training: TrainingSpec) -> Workload:
    """Twenty-four 32768-wide linear blocks: 25.8 billion parameters. Over 8 ranks on an 80 GB
    card only full sharding holds them: ZeRO-2 keeps every block's weights gathered (in bf16:
    52 GB) from forward to backward beside the rank's 52 GB of fp32 state."""
    return _linear_stack(32768, 24)


def linear_stack_32k(training: TrainingSpec) -> Workload:
    """Twelve 32768-wide linear blocks: 12.9 billion parameters, whose fp32 weights, gradients
    and AdamW states (206 GB) fit an 80 GB card only fully sharded over 8 ranks; for estimates
    on fake tensors alone (a real one would not fit in any host)."""
    return _linear_stack(32768, 12)
