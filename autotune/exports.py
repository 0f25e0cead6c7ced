"""Paste-ready settings for a recommendation, in each ecosystem's own key names.

Pure and torch-free: `build_exports` turns a `Recommendation` into plain dicts (Hugging Face
`TrainingArguments` kwargs, Axolotl YAML keys, DeepSpeed JSON keys, Lightning arguments) plus
the source of a complete plain-PyTorch training loop; `render_exports` turns those into text.

Version rule for Hugging Face: transformers 5 renamed the `TrainingArguments` flag
`gradient_checkpointing` to `activation_checkpointing` (the old name still works in 5.x but
warns that v6 removes it). `hf` uses `activation_checkpointing` when the given transformers
version is 5 or later and `gradient_checkpointing` for 4.x. When the version is unknown (None)
it uses `gradient_checkpointing`, the one name every release before v6 accepts. The rendered
text states which rule applied.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from autotune.schemas import Exports, Recommendation

_ACTIVATION_CHECKPOINTING_SINCE_MAJOR = 5


def _transformers_major(version: str) -> int:
    match = re.match(r"\s*v?(\d+)\.", version)
    if match is None:
        raise ValueError(f"not a transformers version: {version!r}")
    return int(match.group(1))


def hf_checkpointing_key(transformers_version: str | None) -> str:
    """The `TrainingArguments` flag that turns on activation checkpointing for this version."""
    if transformers_version is None:
        return "gradient_checkpointing"
    if _transformers_major(transformers_version) >= _ACTIVATION_CHECKPOINTING_SINCE_MAJOR:
        return "activation_checkpointing"
    return "gradient_checkpointing"


def build_exports(
    rec: Recommendation, *, token_model: bool, transformers_version: str | None
) -> Exports:
    """Settings that reproduce `rec` in Hugging Face, Axolotl, DeepSpeed, Lightning and plain
    PyTorch.

    Args:
        rec: The recommended configuration.
        token_model: True for language models: the PyTorch loop then normalises the loss by
            label tokens of the whole step, else by samples.
        transformers_version: The user's transformers version, or None when unknown; picks the
            Hugging Face checkpointing key (see the module docstring).

    Raises:
        ValueError: when `rec.global_batch` is not micro-batch * accumulation * world size.
    """
    b, accumulation, world = rec.micro_batch, rec.accumulation_steps, rec.world_size
    if b * accumulation * world != rec.global_batch:
        raise ValueError(
            f"inconsistent recommendation: {b} * {accumulation} * {world} != {rec.global_batch}"
        )
    hf = {
        "per_device_train_batch_size": b,
        "gradient_accumulation_steps": accumulation,
        hf_checkpointing_key(transformers_version): rec.checkpointing,
    }
    axolotl = {
        "micro_batch_size": b,
        "gradient_accumulation_steps": accumulation,
        "gradient_checkpointing": rec.checkpointing,
    }
    deepspeed = {
        "train_batch_size": rec.global_batch,
        "train_micro_batch_size_per_gpu": b,
        "gradient_accumulation_steps": accumulation,
    }
    # Lightning splits these over three objects: the Trainer owns accumulation, the datamodule
    # owns the batch size, and checkpointing has no Trainer flag, so it lives in the module.
    lightning = {
        "trainer": {"accumulate_grad_batches": accumulation},
        "datamodule": {"batch_size": b},
        "module": {"gradient_checkpointing": rec.checkpointing},
    }
    return Exports(
        hf=hf,
        axolotl=axolotl,
        deepspeed=deepspeed,
        lightning=lightning,
        pytorch_loop=_pytorch_loop(rec, token_model=token_model),
    )


def render_exports(exports: Exports) -> dict[str, str]:
    """Paste-ready text per target: `hf` and `lightning` as Python, `axolotl` as YAML,
    `deepspeed` as JSON, `pytorch_loop` as is."""
    batch = _batch_comment(exports.deepspeed)
    return {
        "hf": _render_hf(exports.hf, batch),
        "axolotl": f"# Axolotl config (merge into your YAML)\n{batch}"
        + yaml.safe_dump(exports.axolotl, sort_keys=False),
        "deepspeed": json.dumps(exports.deepspeed, indent=2) + "\n",
        "lightning": _render_lightning(exports.lightning, batch),
        "pytorch_loop": exports.pytorch_loop,
    }


def _batch_comment(deepspeed: dict[str, Any]) -> str:
    """The batch arithmetic as a comment line; the rank count follows from DeepSpeed's
    invariant train_batch_size == micro * accumulation * ranks."""
    micro = deepspeed["train_micro_batch_size_per_gpu"]
    accumulation = deepspeed["gradient_accumulation_steps"]
    ranks = deepspeed["train_batch_size"] // (micro * accumulation)
    return (
        f"# global batch {deepspeed['train_batch_size']} = {micro} per rank x {accumulation} "
        f"accumulation steps x {ranks} rank(s)\n"
    )


def _render_hf(hf: dict[str, Any], batch: str) -> str:
    if "activation_checkpointing" in hf:
        rule = "activation_checkpointing: the flag's name since transformers 5"
    else:
        rule = "gradient_checkpointing: the flag's name before transformers 5 (5.x: deprecated)"
    kwargs = "".join(f"    {key}={value!r},\n" for key, value in hf.items())
    return (
        f"# Hugging Face TrainingArguments; {rule}.\n{batch}"
        "from transformers import TrainingArguments\n\n"
        f"args = TrainingArguments(\n{kwargs}    # ... your other arguments\n)\n"
    )


def _render_lightning(lightning: dict[str, Any], batch: str) -> str:
    trainer_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["trainer"].items())
    datamodule_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["datamodule"].items())
    if lightning["module"]["gradient_checkpointing"]:
        checkpointing = (
            "# Activation checkpointing: ON. Lightning has no Trainer flag for it; enable it in\n"
            "# your LightningModule, e.g. for a Hugging Face model:\n"
            "#     def configure_model(self):\n"
            "#         self.model.gradient_checkpointing_enable(\n"
            '#             gradient_checkpointing_kwargs={"use_reentrant": False}\n'
            "#         )\n"
        )
    else:
        checkpointing = "# Activation checkpointing: off (Lightning has no Trainer flag for it).\n"
    return (
        "# Lightning: the Trainer owns accumulation; batch_size is per rank, in your datamodule.\n"
        f"{batch}import lightning as L\n\n"
        f"trainer = L.Trainer({trainer_kwargs})\n"
        f"datamodule = YourDataModule({datamodule_kwargs})\n" + checkpointing
    )


# ---------------------------------------------------------------------------------------------
# The plain PyTorch loop. The parts below are the loop's own source text; only the header is
# filled in with the recommendation's numbers.

_LOOP_IMPORTS = """
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

"""

_TOKEN_LOSS = '''

def to_device(batch, device):
    return {key: value.to(device) for key, value in batch.items()}


def count_targets(micro_batches):
    """Label tokens of this rank's micro-batches, after the one-position shift."""
    return sum(int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for batch in micro_batches)


def loss_sum(model, batch):
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
'''

_SAMPLE_LOSS = '''

def to_device(batch, device):
    inputs, labels = batch
    return inputs.to(device), labels.to(device)


def count_targets(micro_batches):
    """Samples in this rank's micro-batches."""
    return sum(len(labels) for _, labels in micro_batches)


def loss_sum(model, batch):
    """Summed (not averaged) cross-entropy of one micro-batch."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs).float(), labels, reduction="sum")
'''

_LOOP_BODY = '''

class CheckpointedBlock(nn.Module):
    """Recomputes the wrapped block's activations in backward instead of keeping them."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def enable_checkpointing(model):
    """Hugging Face models have a switch; any other model gets every block of its largest
    nn.ModuleList (the layers, in most models) wrapped in CheckpointedBlock."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    block_lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not block_lists:
        raise ValueError("no nn.ModuleList of blocks found: wrap your blocks in CheckpointedBlock")
    blocks = max(block_lists, key=len)
    for index, block in enumerate(blocks):
        blocks[index] = CheckpointedBlock(block)


def prepare_model(model):
    """Checkpointing as recommended, then DDP on several ranks. Call before creating the
    optimizer, after moving the model to its device."""
    if CHECKPOINTING:
        enable_checkpointing(model)
    if WORLD_SIZE > 1:
        model = nn.parallel.DistributedDataParallel(model)
    return model


def check_world_size():
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != WORLD_SIZE:
        raise RuntimeError(
            f"tuned for {WORLD_SIZE} ranks but running on {world_size}: "
            f"launch with torchrun --nproc-per-node {WORLD_SIZE} (or across nodes)"
        )


def train_step(model, optimizer, micro_batches):
    """One optimizer step over this rank's ACCUMULATION_STEPS micro-batches.

    The loss is the sum over every micro-batch of every rank divided by the number of loss
    targets in all of them, so the gradient equals the full-batch gradient whatever the split.
    Gradients are zeroed first and left in place after the update. Returns the mean loss of
    this rank's micro-batches.
    """
    check_world_size()
    if len(micro_batches) != ACCUMULATION_STEPS:
        raise ValueError(f"expected {ACCUMULATION_STEPS} micro-batches, got {len(micro_batches)}")
    device = next(model.parameters()).device
    micro_batches = [to_device(batch, device) for batch in micro_batches]
    # The normaliser must be known before the first backward: count this rank's targets, then
    # sum the counts over ranks.
    local_targets = count_targets(micro_batches)
    num_targets = torch.tensor(local_targets, dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(num_targets)
    # DDP averages gradients over ranks; the factor WORLD_SIZE turns that mean back into a sum.
    scale = WORLD_SIZE / max(int(num_targets.item()), 1)
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    for index, batch in enumerate(micro_batches):
        is_last = index == len(micro_batches) - 1
        # DDP all-reduces gradients only on the last micro-batch of the step.
        no_sync = getattr(model, "no_sync", None)
        context = contextlib.nullcontext() if is_last or no_sync is None else no_sync()
        with context:
            loss = loss_sum(model, batch)
            (loss * scale).backward()
        total_loss += loss.item()
    optimizer.step()
    return total_loss / max(local_targets, 1)


def train(model, optimizer, data_loader, num_steps):
    """num_steps optimizer steps, each over ACCUMULATION_STEPS consecutive loader batches.

    The loader must yield MICRO_BATCH samples per batch on every rank, e.g.
    DataLoader(dataset, batch_size=MICRO_BATCH, drop_last=True), with a DistributedSampler
    when WORLD_SIZE > 1. Returns each step's mean loss.
    """
    model.train()
    losses = []
    while len(losses) < num_steps:
        micro_batches = []
        steps_before = len(losses)
        for batch in data_loader:
            micro_batches.append(batch)
            if len(micro_batches) == ACCUMULATION_STEPS:
                losses.append(train_step(model, optimizer, micro_batches))
                micro_batches = []
                if len(losses) == num_steps:
                    break
        if len(losses) == steps_before:
            raise ValueError(f"the loader yields fewer than {ACCUMULATION_STEPS} batches")
    return losses
'''

_TOKEN_DEMO = '''

class TinyLM(nn.Module):
    """A stand-in for your model, so that this file runs as is."""

    def __init__(self, vocab_size=64, dim=32, n_layer=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
            for _ in range(n_layer)
        )
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def demo_batches(num_batches, seq_len=16, vocab_size=64):
    """Right-padded batches of random lengths, labels -100 at padding."""
    for _ in range(num_batches):
        input_ids = torch.randint(vocab_size, (MICRO_BATCH, seq_len))
        lengths = torch.randint(2, seq_len + 1, (MICRO_BATCH, 1))
        labels = input_ids.masked_fill(torch.arange(seq_len) >= lengths, IGNORE_INDEX)
        yield {"input_ids": input_ids, "labels": labels}
'''

_SAMPLE_DEMO = '''

class TinyNet(nn.Module):
    """A stand-in for your model, so that this file runs as is."""

    def __init__(self, in_features=16, dim=32, n_layer=2, num_classes=10):
        super().__init__()
        self.stem = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
            for _ in range(n_layer)
        )
        self.head = nn.Linear(dim, num_classes)

    def forward(self, inputs):
        x = self.stem(inputs.flatten(1))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def demo_batches(num_batches, in_features=16, num_classes=10):
    for _ in range(num_batches):
        yield torch.randn(MICRO_BATCH, in_features), torch.randint(num_classes, (MICRO_BATCH,))
'''

_DEMO_MAIN = """

def main():
    if WORLD_SIZE > 1:
        dist.init_process_group()  # torchrun provides the rendezvous environment
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = prepare_model(DemoModel().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = train(model, optimizer, list(demo_batches(2 * ACCUMULATION_STEPS)), num_steps=2)
    print(f"loss per optimizer step: {losses}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _pytorch_loop(rec: Recommendation, *, token_model: bool) -> str:
    if token_model:
        normaliser = (
            "Loss: summed token cross-entropy of the whole optimizer step divided by the number\n"
            "of label tokens (labels != -100) in all of its micro-batches on all ranks, so\n"
            "every token weighs the same whatever the split and the padding. Batches are dicts:\n"
            '"labels" holds the input ids with -100 at padding (Hugging Face convention; the\n'
            "loop shifts them), every other key is passed to the model as a keyword."
        )
    else:
        normaliser = (
            "Loss: summed cross-entropy of the whole optimizer step divided by the number of\n"
            "samples in all of its micro-batches on all ranks. Batches are (inputs, labels)."
        )
    if rec.world_size > 1:
        ranks = (
            f"\nOn {rec.world_size} ranks: launch with torchrun (one process per GPU); the label\n"
            "count is all-reduced across ranks before the first backward, and the loss is\n"
            f"multiplied by {rec.world_size} to undo DDP's averaging of gradients over ranks.\n"
        )
    else:
        ranks = ""
    header = (
        '"""Plain PyTorch training loop generated by autotune.\n\n'
        f"Micro-batch {rec.micro_batch} per rank, {rec.accumulation_steps} accumulation steps, "
        f"{rec.world_size} rank(s):\n"
        f"{rec.global_batch} samples per optimizer step; activation checkpointing "
        f"{'on' if rec.checkpointing else 'off'}.\n"
        f"{normaliser}\n{ranks}"
        'Run it as is for a demo on random data; replace DemoModel and the data with yours.\n"""\n'
    )
    constants = (
        f"MICRO_BATCH = {rec.micro_batch}\n"
        f"ACCUMULATION_STEPS = {rec.accumulation_steps}\n"
        f"WORLD_SIZE = {rec.world_size}\n"
        "GLOBAL_BATCH = MICRO_BATCH * ACCUMULATION_STEPS * WORLD_SIZE"
        f"  # {rec.global_batch}\n"
        f"CHECKPOINTING = {rec.checkpointing}\n"
        "IGNORE_INDEX = -100\n"
    )
    loss = _TOKEN_LOSS if token_model else _SAMPLE_LOSS
    if token_model:
        demo = _TOKEN_DEMO + "\n\nDemoModel = TinyLM\n"
    else:
        demo = _SAMPLE_DEMO + "\n\nDemoModel = TinyNet\n"
    return header + _LOOP_IMPORTS + constants + loss + _LOOP_BODY + demo + _DEMO_MAIN
