"""The task part of the generated training loop for models that classify samples: batches are
(inputs, labels) and the loss is normalised by samples. `train_loop.py` imports it only for
the type checker; the exporter inlines everything below the imports."""

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    inputs, labels = batch
    return inputs.to(device), labels.to(device)


def count_targets(micro_batches: list[Batch]) -> int:
    """Samples in this rank's micro-batches."""
    return sum(len(labels) for _, labels in micro_batches)


def loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed (not averaged) cross-entropy of one micro-batch."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs).float(), labels, reduction="sum")


class TinyNet(nn.Module):
    """A stand-in for your model, so that this file runs as is."""

    def __init__(
        self, in_features: int = 16, dim: int = 32, n_layer: int = 2, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
            for _ in range(n_layer)
        )
        self.head = nn.Linear(dim, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.stem(inputs.flatten(1))
        for block in self.blocks:
            x = x + block(x)
        logits: torch.Tensor = self.head(x)
        return logits


def demo_batches(
    num_batches: int, micro_batch: int, in_features: int = 16, num_classes: int = 10
) -> list[Batch]:
    """Random inputs and labels."""
    return [
        (torch.randn(micro_batch, in_features), torch.randint(num_classes, (micro_batch,)))
        for _ in range(num_batches)
    ]


DemoModel = TinyNet
