"""The task part of the generated training loop for language models: batches are dicts whose
"labels" hold the input ids with IGNORE_INDEX at padding, and the loss is normalised by label
tokens. `train_loop.py` imports it only for the type checker; the exporter inlines everything
below the imports."""

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here" (padding)

Batch = dict[str, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {key: value.to(device) for key, value in batch.items()}


def count_targets(micro_batches: list[Batch]) -> int:
    """Label tokens of this rank's micro-batches, after the one-position shift."""
    return sum(int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for batch in micro_batches)


def loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed (not averaged) next-token cross-entropy of one micro-batch."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    output = model(**inputs)
    logits = getattr(output, "logits", output)  # Hugging Face models return an output object
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class TinyLM(nn.Module):
    """A stand-in for your model, so that this file runs as is."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layer: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
            for _ in range(n_layer)
        )
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits: torch.Tensor = self.head(x)
        return logits


def demo_batches(
    num_batches: int, micro_batch: int, seq_len: int = 16, vocab_size: int = 64
) -> list[Batch]:
    """Right-padded batches of random lengths, labels IGNORE_INDEX at padding."""
    batches = []
    for _ in range(num_batches):
        input_ids = torch.randint(vocab_size, (micro_batch, seq_len))
        lengths = torch.randint(2, seq_len + 1, (micro_batch, 1))
        labels = input_ids.masked_fill(torch.arange(seq_len) >= lengths, IGNORE_INDEX)
        batches.append({"input_ids": input_ids, "labels": labels})
    return batches


DemoModel = TinyLM
