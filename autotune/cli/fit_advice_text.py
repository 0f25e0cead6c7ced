"""What `probe` and `tune` print when a spec fits nowhere: the changes that make it fit, each
with its spec diff, fastest first (`autotune.engine.remedy_trials`)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.core.bytesize import format_bytes
from autotune.core.schemas import FitAdvice


def spec_diff_text(diff: dict[str, Any]) -> str:
    """`training.field: value` pairs, as a spec file writes them."""
    return ", ".join(
        f"training.{name}: {value if isinstance(value, str | int) else json.dumps(value)}"
        for name, value in diff.items()
    )


def print_fit_advice(console: Console, advice: FitAdvice) -> None:
    """The remedies as a table, then what was tried in vain and what is not modelled."""
    if not advice.remedies:
        console.print("[red]Nothing tried makes it fit.[/red]")
    else:
        table = Table(
            title="What would make it fit (each verified by a traced step, micro-batch 1; "
            "fastest first)"
        )
        for column in (
            "change",
            "spec diff",
            "GPUs",
            "checkpointing",
            "peak per GPU",
            "samples/s (job)",
            "samples/s per GPU",
            "tokens/s (job)",
        ):
            table.add_column(
                column, justify="left" if column.startswith(("change", "spec")) else "right"
            )
        for remedy in advice.remedies:
            table.add_row(
                remedy.change,
                spec_diff_text(remedy.spec_diff),
                str(remedy.world_size),
                "on" if remedy.checkpointing else "off",
                f"{format_bytes(remedy.peak_bytes)} of {format_bytes(remedy.capacity_bytes)}",
                _rate(remedy.samples_per_s),
                _rate(remedy.samples_per_s_per_gpu),
                _rate(remedy.tokens_per_s, digits=0),
            )
        console.print(table)
    if advice.still_too_large:
        console.print("Still too large: " + "; ".join(advice.still_too_large), soft_wrap=True)
    for note in advice.not_modelled:
        console.print(f"Not modelled: {note}", soft_wrap=True)


def _rate(value: float | None, *, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


__all__ = ["print_fit_advice", "spec_diff_text"]
