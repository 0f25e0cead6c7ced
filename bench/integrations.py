"""Lightning's `BatchSizeFinder` beside `AutotuneBatchSize` on the same LightningModule and the
same emulated GPU: trials, wall time, the batch size each sets, and whether the target global
batch is kept. Writes bench/results/integrations.{json,md}.

    .venv/bin/python bench/integrations.py

`BatchSizeFinder` runs real `Trainer` steps inside a simulated CUDA device
(`autotune.engine.devices.simulated_cuda`): every storage is malloc'd from the caching-allocator
model, and a refused allocation raises torch's "CUDA out of memory" error, the message
Lightning's `is_oom_error` catches. The device is a MIG-sized slice whose allocator gets
`CAPACITY_BYTES` once CUDA's context, kernels and library handles are loaded (measured by a
calibration step first; tests/autotune_tests/integrations/lightning_card.py).
`AutotuneBatchSize` measures on the emulated GPU of the same allocator capacity with the cuBLAS
workspaces the card keeps resident in it, one set per thread that runs matmuls (`card_budget`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import BatchSizeFinder

from autotune.integrations.lightning import AutotuneBatchSize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.autotune_tests.integrations.lightning_card import (  # noqa: E402
    CAPACITY_BYTES,
    card_budget,
    fits_on_card,
    outside_allocator_bytes,
    quiet_trainer,
    simulated_card,
)
from tests.autotune_tests.integrations.test_lightning import Rows, Wide  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_GLOBAL_BATCH = 512


def run_batch_size_finder(mode: str, outside_bytes: int) -> dict[str, Any]:
    finder = BatchSizeFinder(mode=mode, steps_per_trial=1)
    with simulated_card(outside_bytes):
        start = time.perf_counter()
        fit = quiet_trainer(finder)
        module = Wide()
        fit.fit(module, datamodule=Rows())
        wall_s = time.perf_counter() - start
    found = finder.optimal_batch_size or 0
    accumulation = int(fit.accumulate_grad_batches)
    # One training step per size tried (steps_per_trial=1), then the fit's own step.
    tried = module.seen[:-1]
    return {
        "callback": f"BatchSizeFinder(mode={mode!r})",
        "sizes_tried": tried,
        "trials": len(tried),
        "wall_s": round(wall_s, 2),
        "batch_size": found,
        "accumulate_grad_batches": accumulation,
        "global_batch": found * accumulation,
        "target_kept": found * accumulation == TARGET_GLOBAL_BATCH,
        "fits_on_card": True,  # it ran there
    }


def run_autotune(outside_bytes: int) -> dict[str, Any]:
    callback = AutotuneBatchSize(
        target_global_batch=TARGET_GLOBAL_BATCH, gpu=card_budget(), seconds_per_trial=0.2
    )
    start = time.perf_counter()
    fit = quiet_trainer(callback)
    fit.fit(Wide(), datamodule=Rows())
    wall_s = time.perf_counter() - start
    result = callback.result
    assert result is not None and result.recommendation is not None
    attempts = [a.micro_batch for m in result.probe.modes for a in m.attempts]
    rec = result.recommendation
    return {
        "callback": "AutotuneBatchSize",
        "sizes_tried": attempts,
        "trials": len(attempts) + len(result.trials),
        "probe_steps": len(attempts),
        "tuning_trials": len(result.trials),
        "max_micro_batch": {str(m.checkpointing): m.max_micro_batch for m in result.probe.modes},
        "wall_s": round(wall_s, 2),
        "batch_size": rec.micro_batch,
        "accumulate_grad_batches": int(fit.accumulate_grad_batches),
        "global_batch": rec.micro_batch * int(fit.accumulate_grad_batches),
        "target_kept": rec.micro_batch * int(fit.accumulate_grad_batches) == TARGET_GLOBAL_BATCH,
        "fits_on_card": fits_on_card(rec.micro_batch, rec.accumulation_steps, outside_bytes),
        "max_fits_on_card": {
            str(size): fits_on_card(size, 1, outside_bytes)
            for size in (
                result.probe.modes[0].max_micro_batch,
                result.probe.modes[0].max_micro_batch + 1,
                448,
            )
        },
    }


def main() -> None:
    torch.manual_seed(0)
    load_before = os.getloadavg()
    outside_bytes = outside_allocator_bytes()
    workspace_bytes = sum(card_budget().blas_workspace_sizes)
    rows = [
        run_batch_size_finder("power", outside_bytes),
        run_batch_size_finder("binsearch", outside_bytes),
        run_autotune(outside_bytes),
    ]
    meta = {
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
        "module": "tests/autotune_tests/integrations/test_lightning.py:Wide (64 -> 8192 -> 10)",
        "capacity_bytes": CAPACITY_BYTES,
        "target_global_batch": TARGET_GLOBAL_BATCH,
        "outside_allocator_bytes": outside_bytes,
        "blas_workspace_bytes": workspace_bytes,
        # Wall times depend on what else the shared machine runs: its 1-minute load average.
        "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    RESULTS.joinpath("integrations.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# Lightning: BatchSizeFinder beside AutotuneBatchSize",
        "",
        f"{meta['machine']}, {meta['cpus']} CPUs shared with other work (1-minute load "
        f"average {meta['load_average_1min'][0]} at the start, {meta['load_average_1min'][1]} "
        "at the end: wall times are that loaded machine's). Produced by "
        "`bench/integrations.py`. The same LightningModule "
        f"({meta['module']}), AdamW, fp32, on an emulated GPU whose caching allocator gets "
        f"{CAPACITY_BYTES // 2**20} MiB; target global batch {TARGET_GLOBAL_BATCH}. "
        "BatchSizeFinder runs inside the simulated CUDA device (its OOM is torch's message, "
        "which Lightning catches); AutotuneBatchSize measures on the emulated GPU of the same "
        "allocator capacity with the cuBLAS workspaces the card keeps resident in it "
        f"({workspace_bytes / 2**20:.2f} MiB: one set for the forward thread, one for "
        "autograd's backward thread).",
        "",
        "| callback | trials | sizes tried | wall s | batch size | accumulation | global batch "
        "| target kept | trains on the simulated card |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['callback']} | {row['trials']} | {row['sizes_tried']} | {row['wall_s']} "
            f"| {row['batch_size']} | {row['accumulate_grad_batches']} | {row['global_batch']} "
            f"| {'yes' if row['target_kept'] else 'no'} "
            f"| {'yes' if row['fits_on_card'] else 'no'} |"
        )
    auto = rows[-1]
    lines += [
        "",
        f"AutotuneBatchSize's trials: {auto['probe_steps']} probe steps (largest micro-batch "
        f"without/with checkpointing: {auto['max_micro_batch']}; the module has no "
        f"checkpointing switch) and {auto['tuning_trials']} measured configurations.",
        "",
        "A plain fit of one step on the simulated card at the probe's largest micro-batch, one "
        "more, and 448 (what the emulated GPU answered when it was given the capacity less one "
        f"set of workspaces, as bytes), after a warm-up step at 2, trains: "
        f"{auto['max_fits_on_card']}.",
        "",
    ]
    RESULTS.joinpath("integrations.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
