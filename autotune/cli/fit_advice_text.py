"""What `probe` and `tune` print when a spec fits nowhere: the changes that make it fit, each
with its spec diff, fastest first (`autotune.engine.remedy_trials`). A numbered list, not a
table: a change and its diff stay readable at any terminal width."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape

from autotune.core.bytesize import format_bytes
from autotune.core.schemas import FitAdvice, Remedy


def spec_diff_text(diff: dict[str, Any]) -> str:
    """`training.field: value` pairs, as a spec file writes them."""
    return ", ".join(
        f"training.{name}: {value if isinstance(value, str | int) else json.dumps(value)}"
        for name, value in diff.items()
    )


def remedy_text(remedy: Remedy) -> str:
    """One remedy for people: its speed (the whole job's, and per GPU), mode and peak."""
    if remedy.samples_per_s is None:
        speed = "no speed (not a named GPU)"
    else:
        speed = f"{remedy.samples_per_s:,.2f} samples/s for the job"
        if remedy.world_size > 1 and remedy.samples_per_s_per_gpu is not None:
            speed += f" ({remedy.samples_per_s_per_gpu:,.2f} per GPU)"
        if remedy.tokens_per_s is not None:
            speed += f", {remedy.tokens_per_s:,.0f} tokens/s"
    return (
        f"{remedy.change}: {speed}; checkpointing {'on' if remedy.checkpointing else 'off'}, "
        f"peak {format_bytes(remedy.peak_bytes)} of {format_bytes(remedy.capacity_bytes)}"
        f"{' per GPU' if remedy.world_size > 1 else ''}"
    )


def print_fit_advice(console: Console, advice: FitAdvice) -> None:
    """The remedies, numbered fastest first with their spec diffs; then what was tried in vain
    and what is not modelled."""
    if not advice.remedies:
        console.print("[red]Nothing tried makes it fit.[/red]")
    else:
        console.print(
            "[bold]What would make it fit[/bold] (each change traced at micro-batch 1 on the "
            "same GPU; fastest first):",
            soft_wrap=True,
        )
        for number, remedy in enumerate(advice.remedies, start=1):
            console.print(f"{number:2d}. {escape(remedy_text(remedy))}", soft_wrap=True)
            console.print(f"    {escape(spec_diff_text(remedy.spec_diff))}", soft_wrap=True)
    if advice.still_too_large:
        console.print("Still too large: " + "; ".join(advice.still_too_large), soft_wrap=True)
    for note in advice.not_modelled:
        console.print(f"Not modelled: {note}", soft_wrap=True)


__all__ = ["print_fit_advice", "remedy_text", "spec_diff_text"]
