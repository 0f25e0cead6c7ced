"""The plain PyTorch loop: `autotune/templates/train_loop.py` with the task's source inlined
(`sample_task.py` or `token_task.py`), a docstring that states the recommendation, and its
numbers and setup as constants (precision, weights, optimizer, adapters, sharding). The
templates are read as text, never imported (they import torch; this module does not).
"""

from __future__ import annotations

import ast
import importlib.resources
import re
import sys
from typing import Any

from autotune.core.exports.measured import MeasuredRun
from autotune.core.exports.notes import shared_notes
from autotune.core.schemas import OptimizerName, Precision, Sharding

_TEMPLATES = "autotune.templates"
_TASK_MARKER = "# autotune-template: task\n"


def _template(name: str) -> str:
    return importlib.resources.files(_TEMPLATES).joinpath(name).read_text(encoding="utf-8")


def _split_module(source: str) -> tuple[list[str], str]:
    """A template's top-level imports (one statement per line, our own templates' imports left
    out) and its source after the last import."""
    tree = ast.parse(source)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    statements = [
        ast.unparse(node)
        for node in imports
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_TEMPLATES))
    ]
    last_line = max(node.end_lineno or node.lineno for node in imports)
    rest = "".join(source.splitlines(keepends=True)[last_line:])
    return statements, rest.lstrip("\n")


def _import_block(statements: list[str]) -> str:
    """The statements in isort's order: standard library first, then the rest; plain imports
    before from-imports, each group by module."""

    def module(statement: str) -> str:
        return statement.split()[1]

    def key(statement: str) -> tuple[bool, str]:
        return statement.startswith("from "), module(statement).lower()

    unique = set(statements)
    stdlib = sorted(
        (s for s in unique if module(s).split(".")[0] in sys.stdlib_module_names), key=key
    )
    others = sorted(unique - set(stdlib), key=key)
    return "\n\n".join("\n".join(group) for group in (stdlib, others) if group) + "\n"


def _literal(value: dict[str, Any] | None) -> str:
    """A dict as the Python source of a literal, one key per line."""
    if value is None:
        return "None"
    items = "".join(f"    {key!r}: {item!r},\n" for key, item in value.items())
    return "{\n" + items.replace("'", '"') + "}"


def _string(value: str | None) -> str:
    return "None" if value is None else f'"{value}"'


def _set_constant(source: str, name: str, value: str) -> str:
    source, count = re.subn(
        rf"^{name}((?:: [^=]+)?) = .*$",
        lambda match: f"{name}{match.group(1)} = {value}",
        source,
        flags=re.MULTILINE,
    )
    if count != 1:
        raise AssertionError(f"template train_loop.py: {count} definitions of {name}")
    return source


def _setup_lines(run: MeasuredRun) -> str:
    """The measured setup in words, when it is not the demo's fp32 weights and torch AdamW."""
    lines = []
    if run.bf16_weights:
        lines.append(
            "Weights in bf16 with no fp32 master copy (WEIGHTS_DTYPE; Hugging Face:\n"
            "from_pretrained(..., dtype=torch.bfloat16)), computing under bf16 autocast.\n"
        )
    elif run.precision is not Precision.FP32:
        scaler = " with a GradScaler" if run.precision is Precision.FP16 else ""
        lines.append(
            "fp32 weights, forward under "
            f"torch.autocast(dtype=torch.{run.autocast_dtype}){scaler}.\n"
        )
    if run.optimizer is OptimizerName.ADAMW_8BIT:
        eight_bit = run.eight_bit_adamw
        lines.append(
            f"Optimizer: {eight_bit.class_path} (8-bit states; pip install {eight_bit.library}).\n"
        )
    elif run.optimizer is not OptimizerName.ADAMW:
        lines.append(f"Optimizer: {run.optimizer} (OPTIMIZER; see make_optimizer).\n")
    return "".join(lines)


def _normaliser(token_model: bool) -> str:
    if token_model:
        return (
            "Loss: summed token cross-entropy of the whole optimizer step divided by the number\n"
            "of label tokens (labels != -100) in all of its micro-batches on all ranks, so\n"
            "every token weighs the same whatever the split and the padding. Batches are dicts:\n"
            '"labels" holds the input ids with -100 at padding (Hugging Face convention; the\n'
            "loop shifts them), every other key is passed to the model as a keyword."
        )
    return (
        "Loss: summed cross-entropy of the whole optimizer step divided by the number of\n"
        "samples in all of its micro-batches on all ranks. Batches are (inputs, labels)."
    )


def _ranks(run: MeasuredRun) -> str:
    if run.world_size == 1:
        return ""
    return (
        f"\nOn {run.world_size} ranks: launch with torchrun (one process per GPU); the label\n"
        "count is all-reduced across ranks before the first backward, and the loss is\n"
        f"multiplied by {run.world_size} to undo the averaging of gradients over ranks.\n"
        + (
            "DDP keeps gradients as views of its buckets (gradient_as_bucket_view=True), the\n"
            "memory the recommendation was measured with.\n"
            if run.sharding is Sharding.NONE
            else f"Sharding {run.sharding}, as measured: see SHARDING below.\n"
        )
    )


def pytorch_loop(run: MeasuredRun) -> str:
    header = (
        '"""Plain PyTorch training loop generated by autotune.\n\n'
        f"Micro-batch {run.micro_batch} per rank, {run.accumulation_steps} accumulation steps, "
        f"{run.world_size} rank(s):\n"
        f"{run.global_batch} samples per optimizer step; activation checkpointing "
        f"{'on' if run.checkpointing else 'off'}.\n"
        + "".join(f"{line}.\n" for line in shared_notes(run)[1:])
        + _setup_lines(run)
        + f"{_normaliser(run.token_model)}\n{_ranks(run)}"
        'Run it as is for a demo on random data; replace DemoModel and the data with yours.\n"""\n'
    )
    loop_imports, loop = _split_module(_template("train_loop.py"))
    task_imports, task = _split_module(
        _template("token_task.py" if run.token_model else "sample_task.py")
    )
    if loop.count(_TASK_MARKER) != 1:
        raise AssertionError(f"template train_loop.py: no single {_TASK_MARKER!r}")
    loop = loop.replace(_TASK_MARKER, task)
    for name, value in (
        ("MICRO_BATCH", str(run.micro_batch)),
        ("ACCUMULATION_STEPS", str(run.accumulation_steps)),
        ("WORLD_SIZE", str(run.world_size)),
        ("GLOBAL_BATCH", f"MICRO_BATCH * ACCUMULATION_STEPS * WORLD_SIZE  # {run.global_batch}"),
        ("CHECKPOINTING", str(run.checkpointing)),
        (
            "CHECKPOINT_BLOCKS",
            str(list(range(run.checkpointed_blocks)))
            if run.checkpointed_blocks is not None
            else "None",
        ),
        ("AUTOCAST_DTYPE", _string(run.autocast_dtype)),
        ("WEIGHTS_DTYPE", _string("bfloat16" if run.bf16_weights else "float32")),
        ("OPTIMIZER", _string(run.optimizer.value)),
        ("LORA", _literal(run.lora)),
        ("SHARDING", _string(run.sharding.value)),
        ("SHARD_GROUP_SIZE", str(run.training.shard_group_size or 1)),
        ("ALLOCATOR_CONF", _string(run.allocator_conf)),
    ):
        loop = _set_constant(loop, name, value)
    return f"{header}\n{_import_block(loop_imports + task_imports)}\n{loop}"
