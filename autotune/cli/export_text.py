"""The exports as a user pastes them, on every command that shows them (`tune`, `runs show`,
`make run`): each text exactly as rendered, never wrapped nor cut at the terminal's width (a
cut `lora_dropout=0.05` reads `lora_dropout=0.0`, a valid wrong value), and `--export NAME`
for one of them alone on stdout, so that `--export pytorch > train.py` is the plain loop in a
file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from autotune.core.exports.titles import EXPORT_TITLES
from autotune.core.schemas import Exports

# `--export` names, and the key of `render_exports` each one prints.
EXPORT_KEYS = {
    "hf": "hf",
    "axolotl": "axolotl",
    "deepspeed": "deepspeed",
    "lightning": "lightning",
    "pytorch": "pytorch_loop",
}
# Beside an export printed alone: what its consumer must know and the text cannot carry.
_NOTES_OF = {"deepspeed": ("deepspeed_notes", "data_parallel")}
_NOTES = ("data_parallel",)


def add_export_arg(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--export",
        choices=sorted(EXPORT_KEYS),
        default=None,
        help="print this export alone on stdout, ready to paste or redirect "
        "(--export pytorch > train.py: the plain training loop)",
    )


def write_verbatim(console: Console, text: str) -> None:
    """`text` as it is: no markup, no highlighting, no wrapping, no cropping."""
    console.out(text.rstrip("\n"), highlight=False)


def print_exports(console: Console, exports: Exports, *, loop_path: Path | None = None) -> None:
    """Every export under its title, verbatim. The plain PyTorch loop, a whole program, is
    written to `loop_path` when given (and said where), else named by the flag that prints it."""
    from autotune.core.exports import render_exports

    for key, text in render_exports(exports).items():
        title = EXPORT_TITLES.get(key, key)
        if key == "pytorch_loop":
            lines = text.count("\n")
            if loop_path is None:
                console.print(f"[bold]{title}[/bold] ({lines} lines): --export pytorch > train.py")
                continue
            loop_path.parent.mkdir(parents=True, exist_ok=True)
            loop_path.write_text(text)
            console.print(f"[bold]{title}[/bold] ({lines} lines) written to {loop_path}")
            continue
        console.print(f"[bold]{title}[/bold]")
        write_verbatim(console, text)


def print_one_export(out: Console, err: Console, exports: Exports, name: str) -> None:
    """The export `name` (an `--export` choice) alone on `out`; what its consumer must also
    know (DeepSpeed's notes, which its JSON has no key for) on `err`."""
    from autotune.core.exports import render_exports

    texts = render_exports(exports)
    key = EXPORT_KEYS[name]
    write_verbatim(out, texts[key])
    for note in _NOTES_OF.get(key, _NOTES):
        if note in texts:
            err.print(f"[bold]{EXPORT_TITLES[note]}[/bold]")
            write_verbatim(err, texts[note])
