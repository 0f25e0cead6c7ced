"""The commands' side of training configs read as specs (`autotune.core.configs`): the
options, what the conversion could not map (on stderr), and after `tune` the recommendation's
diff against the file, or with `--write` the file rewritten."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from autotune.cli.options import positive_int
from autotune.core.configs import ConfigFormat, Converted, RankOptions, load_training_file
from autotune.core.schemas import Exports, Recommendation, Sharding

FILE_HELP = (
    "spec file (YAML or JSON), or an Axolotl config, a Hugging Face TrainingArguments JSON or "
    "a DeepSpeed JSON (told by content)"
)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="hub id or local model directory (with config.json): needed for TrainingArguments "
        "and DeepSpeed files, replaces an Axolotl config's base_model",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sample (the longest): needed for TrainingArguments and DeepSpeed files",
    )
    ranks = parser.add_argument_group(
        "ranks of a config file (a spec says them in training:)",
        "a config file rarely says how many GPUs its launcher starts: say it here (one if "
        "neither does); the file's global batch, micro-batch x accumulation x ranks, is kept",
    )
    ranks.add_argument(
        "--world-size", type=positive_int, default=None, metavar="N", help="data-parallel ranks"
    )
    ranks.add_argument(
        "--nodes", type=positive_int, default=None, metavar="N", help="machines the ranks span"
    )
    ranks.add_argument(
        "--gpus-per-node", type=positive_int, default=None, metavar="N", help="ranks per node"
    )
    ranks.add_argument(
        "--sharding",
        choices=[layout.value for layout in Sharding],
        default=None,
        help="replace the file's layout; auto: the tuner chooses, and the diff (or --write) "
        "sets the chosen layout in the file's own keys",
    )


def add_write_arg(parser: argparse.ArgumentParser, *, when: str = "") -> None:
    parser.add_argument(
        "--write",
        action="store_true",
        help="write the recommendation back into the config file (without it the diff is "
        f"printed){when}",
    )


def read_training_file(args: argparse.Namespace, err: Console) -> Converted:
    """The spec of `args.spec`, saying on `err` what a converted file could not carry.

    Raises:
        SpecError: as `load_training_file`.
    """
    ranks = RankOptions(
        world_size=args.world_size,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        sharding=None if args.sharding is None else Sharding(args.sharding),
    )
    converted = load_training_file(args.spec, model=args.model, seq_len=args.seq_len, ranks=ranks)
    if converted.format is not ConfigFormat.SPEC:
        err.print(
            f"read {escape(str(converted.path))} ({converted.format}); not mapped or assumed:",
            soft_wrap=True,
            highlight=False,
        )
        for note in converted.unmapped:
            err.print(f"  {escape(note)}", soft_wrap=True, highlight=False)
    return converted


def write_back(
    args: argparse.Namespace,
    converted: Converted,
    rec: Recommendation | None,
    exports: Exports | None,
    console: Console,
) -> None:
    """The recommendation against the file: its diff on `console`, and with `--write` the
    file rewritten. Nothing for a spec file or without a recommendation."""
    from autotune.core.configs.writeback import recommended_settings, rewritten, unified_diff

    if converted.format is ConfigFormat.SPEC or rec is None or exports is None:
        return
    path = Path(converted.path)
    settings, notes = recommended_settings(converted, rec, exports)
    before = path.read_text(encoding="utf-8")
    after = rewritten(converted, before, settings)
    diff = unified_diff(before, after, str(path))
    console.print(
        escape(diff) if diff else f"{escape(str(path))}: already as recommended",
        soft_wrap=True,
        highlight=False,
        end="" if diff else "\n",
    )
    for note in notes:
        console.print(f"note: {escape(note)}", soft_wrap=True, highlight=False)
    if getattr(args, "write", False) and diff:
        path.write_text(after, encoding="utf-8")
        console.print(f"wrote {escape(str(path))}", soft_wrap=True, highlight=False)
