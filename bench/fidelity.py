"""How faithful the emulated GPU's memory is: live bytes against the caching allocator's reserved
memory on the zoo, and predictions of published real-GPU measurements.

Two parts, each writing its rows into bench/results/fidelity.json (a part run again replaces its
rows) and re-rendering bench/results/fidelity.md:

- `grid`: every preset x precision x checkpointing mode at two capacities, probed twice on the
  emulated GPU: counting live tensor bytes against the capacity (as it did before the allocator
  model) and counting the allocator's reserved memory (as it does now). Per row: both maxima,
  and reserved / allocated at the peak of the reserved maximum.
- `published`: the single-GPU table of Hugging Face's "Methods and tools for efficient training
  on a single GPU" (2022; bert-large-uncased classifier, 512 tokens, V100 16 GB, memory as NVML
  "used"), each row re-run as that Trainer ran it, on the emulated V100: predicted against
  published memory, in %.

    .venv/bin/python bench/fidelity.py grid [--quick]
    .venv/bin/python bench/fidelity.py published [--rows 0,1]
    .venv/bin/python bench/fidelity.py --report
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.presets import PRESETS
from autotune.core.schemas import ModeProbe, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.emulation.autocast import cuda_autocast_policy
from autotune.engine.emulation.tracker import resident_tensors
from autotune.engine.probe import probe

RESULTS = Path(__file__).resolve().parent / "results"
RESULTS_JSON = RESULTS / "fidelity.json"
RESULTS_MD = RESULTS / "fidelity.md"
MiB = 2**20
GiB = 2**30

# -- grid -------------------------------------------------------------------------------------

SEQ_LEN = 128
CAPACITIES_BYTES = (512 * MiB, 2 * GiB)
# fp16 is left out: its tensors are as large as bf16's (the GradScaler adds two scalars), and
# this CPU runs fp16 matrix products an order of magnitude slower (no fp16 units).
PRECISIONS = ("fp32", "bf16")
MAX_MICRO_BATCH = 2048


def _grid_spec(preset: str, precision: str) -> Spec:
    training: dict[str, Any] = {"precision": precision, "max_micro_batch": MAX_MICRO_BATCH}
    if PRESETS[preset].kind == "decoder":
        training["seq_len"] = SEQ_LEN
    return Spec.model_validate({"model": {"preset": preset}, "training": training})


def _at_max(mode: ModeProbe) -> dict[str, Any]:
    at = [a for a in mode.attempts if a.fits and a.micro_batch == mode.max_micro_batch]
    if not at or at[0].peak_allocated_bytes in (None, 0):
        return {"reserved_over_allocated": None, "retries_at_max": None}
    attempt = at[0]
    assert attempt.peak_allocated_bytes is not None
    return {
        "peak_reserved_mib": round(attempt.peak_bytes / MiB, 2),
        "peak_allocated_mib": round(attempt.peak_allocated_bytes / MiB, 2),
        "reserved_over_allocated": round(attempt.peak_bytes / attempt.peak_allocated_bytes, 4),
        "retries_at_max": attempt.num_alloc_retries,
    }


def run_grid(quick: bool, on_row: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Probe every preset x precision at both capacities, calling `on_row` with each row."""
    presets = ["gpt2-tiny", "llama-tiny", "mlp", "cnn"] if quick else list(PRESETS)
    precisions = ("fp32",) if quick else PRECISIONS
    rows = []
    for preset in presets:
        for precision in precisions:
            spec = _grid_spec(preset, precision)
            for capacity_bytes in CAPACITIES_BYTES:
                started = time.perf_counter()
                live = probe(spec, EmulatedDevice(capacity_bytes, model_allocator=False))
                reserved = probe(spec, EmulatedDevice(capacity_bytes))
                seconds = time.perf_counter() - started
                for live_mode, mode in zip(live.modes, reserved.modes, strict=True):
                    row = {
                        "preset": preset,
                        "precision": precision,
                        "checkpointing": mode.checkpointing,
                        "capacity_mib": capacity_bytes // MiB,
                        "max_live": live_mode.max_micro_batch,
                        "max_reserved": mode.max_micro_batch,
                        "capped": mode.capped,
                        "trials_reserved": len(mode.attempts),
                        **_at_max(mode),
                        "seconds": round(seconds, 1),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    on_row(row)
    return rows


# -- published --------------------------------------------------------------------------------

# bert-large-uncased (its config.json on the hub), a sequence classifier with 2 labels.
BERT_LARGE = {
    "vocab_size": 30522,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
BERT_SEQ_LEN = 512
# What NVML showed as used once `torch.ones((1, 1)).to("cuda")` had run, in the same document:
# the CUDA context of that setup (CUDA 11 without lazy loading: every kernel loaded).
PUBLISHED_CONTEXT_MIB = 1343
PUBLISHED_SOURCE = (
    'the transformers documentation, "Efficient training on a single GPU" (2022 version), '
    "bert-large-uncased, 512 x 512 tokens, V100 16 GB, NVML used"
)


@dataclass(frozen=True)
class PublishedRow:
    micro_batch: int
    accumulation: int
    checkpointing: bool
    precision: str  # "fp32" | "fp16"
    optimizer: str  # "adamw" | "adafactor" | "adam8bit"
    published_mib: int


PUBLISHED = (
    PublishedRow(4, 1, False, "fp32", "adamw", 14949),
    PublishedRow(1, 4, False, "fp32", "adamw", 8681),
    PublishedRow(1, 4, True, "fp32", "adamw", 6775),
    PublishedRow(4, 1, False, "fp16", "adamw", 13939),
    PublishedRow(1, 4, True, "fp16", "adamw", 7275),
    PublishedRow(4, 1, False, "fp32", "adafactor", 12295),
    PublishedRow(1, 4, True, "fp16", "adafactor", 4847),
    PublishedRow(4, 1, False, "fp32", "adam8bit", 13085),
    PublishedRow(1, 4, True, "fp16", "adam8bit", 5363),
)


def _bert_large(checkpointing: bool) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model("bert", **BERT_LARGE, num_labels=2)
    # Eager attention: transformers of 2022 computed attention with matmul and softmax, keeping
    # the probabilities and the dropout mask for backward.
    auto: Any = transformers.AutoModelForSequenceClassification
    model: Any = auto.from_config(config, attn_implementation="eager")
    if checkpointing:
        # The Trainer's gradient_checkpointing=True: torch's reentrant checkpoint per layer.
        model.gradient_checkpointing_enable({"use_reentrant": True})
    model.train()
    module: torch.nn.Module = model
    return module


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        # The Trainer's default then, transformers' own AdamW ("adamw_hf"): one parameter at a
        # time, as torch's AdamW with foreach=False.
        return torch.optim.AdamW(model.parameters(), lr=5e-5, foreach=False)
    import transformers.optimization

    # The Trainer's `adafactor=True`.
    adafactor: Any = transformers.optimization.Adafactor
    optimizer: torch.optim.Optimizer = adafactor(
        model.parameters(), lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False
    )
    return optimizer


def _trainer_step(row: PublishedRow, model: torch.nn.Module, optimizer: Any) -> Callable[[], None]:
    """One optimizer step as the Trainer of 2022 ran it: the loss of each micro-batch divided by
    the accumulation steps, fp16 through autocast and a GradScaler, gradients clipped to norm 1,
    and `model.zero_grad()` (torch 1.11's keeps the gradient tensors, zeroed)."""
    scaler = torch.amp.GradScaler("cpu") if row.precision == "fp16" else None
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        for _ in range(row.accumulation):
            ids = torch.randint(BERT_LARGE["vocab_size"], (row.micro_batch, BERT_SEQ_LEN))
            labels = torch.randint(2, (row.micro_batch,), generator=generator)
            with _autocast(row.precision):
                loss = model(input_ids=ids, labels=labels).loss / row.accumulation
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        model.zero_grad(set_to_none=False)

    return step


@contextlib.contextmanager
def _autocast(precision: str) -> Iterator[None]:
    if precision == "fp32":
        yield
        return
    # CUDA's op lists on CPU tensors (autotune.engine.emulation.autocast). The 16-bit tensors are
    # bf16: they are as large as fp16 ones, CUDA's lists are the same for both, and this CPU has no
    # fp16 matrix units (an fp16 step of bert-large did not finish in 11 minutes, fp32 takes 1.5).
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def run_published(
    indices: list[int], on_row: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """Run the published rows `indices`, calling `on_row` with each result as it comes (a row
    of bert-large takes minutes: a run stopped half-way keeps what it measured)."""
    v100 = budget_for(find_gpu("V100 16GB"))
    rows = []
    for index in indices:
        row = PUBLISHED[index]
        base: dict[str, Any] = {
            "row": index,
            "micro_batch": row.micro_batch,
            "accumulation": row.accumulation,
            "checkpointing": row.checkpointing,
            "precision": row.precision,
            "optimizer": row.optimizer,
            "published_mib": row.published_mib,
        }
        if row.optimizer == "adam8bit":
            rows.append(
                {**base, "skipped": "bitsandbytes' 8-bit Adam needs a CUDA build: not run here"}
            )
            print(json.dumps(rows[-1]), flush=True)
            on_row(rows[-1])
            continue
        started = time.perf_counter()
        torch.manual_seed(0)
        model = _bert_large(row.checkpointing)
        optimizer = _optimizer(row.optimizer, model)
        step = _trainer_step(row, model, optimizer)
        device = EmulatedDevice(gpu=v100)
        # The steady state: the optimizer state and the kept gradients exist from step one on.
        warm = device.run_trial(step, micro_batch=row.micro_batch, resident=[], track=False)
        assert warm.fits
        outcome = device.run_trial(
            step, micro_batch=row.micro_batch, resident=resident_tensors(model, optimizer)
        )
        assert outcome.fits and outcome.peak_allocated_bytes is not None
        reserved_mib = outcome.peak_bytes / MiB
        predicted_mib = PUBLISHED_CONTEXT_MIB + reserved_mib
        result = {
            **base,
            "peak_reserved_mib": round(reserved_mib, 1),
            "peak_allocated_mib": round(outcome.peak_allocated_bytes / MiB, 1),
            "predicted_mib": round(predicted_mib, 1),
            "error_pct": round(100 * (predicted_mib - row.published_mib) / row.published_mib, 2),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(json.dumps(result), flush=True)
        rows.append(result)
        on_row(result)
        del model, optimizer, step
    return rows


# -- results ----------------------------------------------------------------------------------


def _load() -> dict[str, Any]:
    if RESULTS_JSON.exists():
        loaded: dict[str, Any] = json.loads(RESULTS_JSON.read_text())
        return loaded
    return {}


def _save(results: dict[str, Any]) -> None:
    RESULTS_JSON.write_text(json.dumps(results, indent=1) + "\n")
    RESULTS_MD.write_text(render(results))


def _machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def render(results: dict[str, Any]) -> str:
    lines = ["# Fidelity of the emulated GPU's memory", ""]
    lines += [
        "Written by `bench/fidelity.py` (what it runs and why: its docstring and",
        "docs/design.md#the-caching-allocator-on-the-emulated-gpu).",
        "",
    ]
    grid = results.get("grid")
    if grid:
        lines += [
            "## Live bytes against reserved memory",
            "",
            f"Machine: {json.dumps(grid['machine'])}. Decoders at {SEQ_LEN} tokens, cap "
            f"{MAX_MICRO_BATCH}. *max live*: the probe's maximum counting live tensor bytes "
            "against the capacity (the emulated GPU before the allocator model); *max "
            "reserved*: counting the caching allocator's reserved memory, as a card runs out. "
            "*reserved/allocated*: at the peak of the reserved maximum.",
            "",
            "| preset | precision | ckpt | capacity | max live | max reserved | change "
            "| reserved/allocated | retries | trials |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in grid["rows"]:
            change = (
                f"{100 * (r['max_reserved'] - r['max_live']) / r['max_live']:+.1f} %"
                if r["max_live"]
                else "-"
            )
            ratio = r.get("reserved_over_allocated")
            lines.append(
                f"| {r['preset']} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} "
                f"| {r['capacity_mib']} MiB | {r['max_live']} | {r['max_reserved']}"
                f"{' (cap)' if r['capped'] else ''} | {change} | "
                f"{'-' if ratio is None else f'{ratio:.3f}'} | "
                f"{'-' if r.get('retries_at_max') is None else r['retries_at_max']} | "
                f"{r['trials_reserved']} |"
            )
        lines.append("")
    published = results.get("published")
    if published:
        lines += [
            "## Published measurements: bert-large on a V100 16 GB",
            "",
            f"Source: {PUBLISHED_SOURCE}. Machine: {json.dumps(published['machine'])}.",
            "",
            "Predicted = the setup's CUDA context as the same document measured it "
            f"({PUBLISHED_CONTEXT_MIB} MiB: `torch.ones((1, 1)).to('cuda')`) + the peak reserved "
            "memory of one steady-state step on the emulated V100 16GB, run as the Trainer ran "
            "it (eager attention, transformers' AdamW one parameter at a time or Adafactor, "
            "gradients clipped, `zero_grad()` keeping the gradients as torch 1.11 did, fp16 by "
            "autocast with CUDA's op lists and a GradScaler; its 16-bit tensors computed in bf16, "
            'as large, since this CPU has no fp16 units). NVML\'s "used" after training is '
            "that context plus the cache, which the allocator never returns. 8-bit Adam rows "
            "need bitsandbytes' CUDA kernels and are not predicted.",
            "",
            "| bs | GA | GC | precision | optimizer | published MiB | predicted MiB | error "
            "| reserved | allocated |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in published["rows"]:
            head = (
                f"| {r['micro_batch']} | {r['accumulation']} | "
                f"{'yes' if r['checkpointing'] else '-'} | {r['precision']} | {r['optimizer']} "
                f"| {r['published_mib']} |"
            )
            if "skipped" in r:
                lines.append(f"{head} - | {r['skipped']} | - | - |")
            else:
                lines.append(
                    f"{head} {r['predicted_mib']:.0f} | {r['error_pct']:+.2f} % | "
                    f"{r['peak_reserved_mib']:.0f} | {r['peak_allocated_mib']:.0f} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("grid", "published"))
    parser.add_argument("--quick", action="store_true", help="grid: 4 small presets, fp32")
    parser.add_argument("--rows", help="published: comma-separated row indices (default all)")
    parser.add_argument("--report", action="store_true", help="re-render fidelity.md only")
    args = parser.parse_args(argv)
    results = _load()
    if args.part == "grid":
        results["grid"] = {"machine": _machine(), "rows": []}

        def add(row: dict[str, Any]) -> None:
            results["grid"]["rows"].append(row)
            _save(results)

        run_grid(args.quick, add)
    elif args.part == "published":
        indices = (
            [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(PUBLISHED)))
        )

        def keep(row: dict[str, Any]) -> None:
            kept = [
                r for r in results.get("published", {}).get("rows", []) if r["row"] != row["row"]
            ]
            results["published"] = {
                "machine": _machine(),
                "rows": sorted([*kept, row], key=lambda r: int(r["row"])),
            }
            _save(results)

        run_published(indices, keep)
    elif not args.report:
        parser.error("give a part (grid, published) or --report")
    _save(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
