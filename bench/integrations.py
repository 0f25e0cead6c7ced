"""Lightning's `BatchSizeFinder` beside `AutotuneBatchSize` on the same LightningModule and the
same emulated GPU: trials, wall time, the batch size each sets, and whether the target global
batch is kept. Writes bench/results/integrations.{json,md}.

    .venv/bin/python bench/integrations.py

`BatchSizeFinder` runs real `Trainer` steps inside a simulated CUDA device
(`autotune.engine.devices.simulated_cuda`): every storage is malloc'd from the caching-allocator
model, and a refused allocation raises torch's "CUDA out of memory" error, the message
Lightning's `is_oom_error` catches. The device is a MIG-sized slice whose allocator gets
`CAPACITY_BYTES` once CUDA's context, kernels and library handles are loaded (measured by a
calibration step first). `AutotuneBatchSize` measures on the emulated GPU of the same
allocator capacity (`memory=`), less the cuBLAS workspaces the simulated card keeps inside it.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.memory import is_oom_error

from autotune.core.gpus.catalogue import find_gpu
from autotune.engine.devices.simulated_cuda import MigSlice, SimulatedCuda
from autotune.integrations.lightning import AutotuneBatchSize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.autotune_tests.integrations.test_lightning import Rows, Wide  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CAPACITY_BYTES = 64 * 2**20
TARGET_GLOBAL_BATCH = 512
GPU = "A100 80GB"
SM_COUNT = 14  # a 1g slice's SMs: what the context's stacks are sized by


def _trainer(callback: Any) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[callback] if callback is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def outside_allocator_bytes() -> int:
    """What the simulated CUDA holds outside its allocator after one training step of the
    module: context, kernels, handles."""
    cuda = SimulatedCuda(find_gpu(GPU), mig=MigSlice("calibration", 2**34, SM_COUNT))
    with cuda:
        _trainer(BatchSizeFinder(init_val=2, max_trials=1)).fit(Wide(), datamodule=Rows())
    return cuda.outside_allocator_bytes


def _simulated_card(outside_bytes: int) -> SimulatedCuda:
    return SimulatedCuda(
        find_gpu(GPU), mig=MigSlice("bench", CAPACITY_BYTES + outside_bytes, SM_COUNT)
    )


def fits_on_card(batch_size: int, accumulation: int, outside_bytes: int) -> bool:
    """Whether a plain fit with this batch size and accumulation trains a step on the
    simulated card (the check of a recommendation made on the emulated GPU), after a warm-up
    step at batch 2 has loaded CUDA's kernels, as a session's first steps do."""
    with _simulated_card(outside_bytes):
        _trainer(None).fit(Wide(), datamodule=Rows(batch_size=2))
        # The warm-up's trainer and module sit in reference cycles: free their storages on
        # the card before the step measured (a script fits once; this one fits twice).
        gc.collect()
        fit = Trainer(
            accelerator="cpu",
            max_steps=1,
            accumulate_grad_batches=accumulation,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        try:
            fit.fit(Wide(), datamodule=Rows(batch_size=batch_size))
        except RuntimeError as error:
            if is_oom_error(error):  # Lightning's own test, as BatchSizeFinder's
                return False
            raise
    return fit.global_step == 1


def run_batch_size_finder(mode: str, outside_bytes: int) -> dict[str, Any]:
    finder = BatchSizeFinder(mode=mode, steps_per_trial=1)
    with _simulated_card(outside_bytes):
        start = time.perf_counter()
        fit = _trainer(finder)
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


def run_autotune(workspace_bytes: int, outside_bytes: int) -> dict[str, Any]:
    callback = AutotuneBatchSize(
        target_global_batch=TARGET_GLOBAL_BATCH,
        memory=CAPACITY_BYTES - workspace_bytes,
        seconds_per_trial=0.2,
    )
    start = time.perf_counter()
    fit = _trainer(callback)
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
            for size in (result.probe.modes[0].max_micro_batch, 320, 256)
        },
    }


def main() -> None:
    torch.manual_seed(0)
    outside_bytes = outside_allocator_bytes()
    workspace_bytes = sum(SimulatedCuda(find_gpu(GPU)).blas_workspace_sizes)
    rows = [
        run_batch_size_finder("power", outside_bytes),
        run_batch_size_finder("binsearch", outside_bytes),
        run_autotune(workspace_bytes, outside_bytes),
    ]
    meta = {
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
        "module": "tests/autotune_tests/integrations/test_lightning.py:Wide (64 -> 8192 -> 10)",
        "capacity_bytes": CAPACITY_BYTES,
        "target_global_batch": TARGET_GLOBAL_BATCH,
        "outside_allocator_bytes": outside_bytes,
        "blas_workspace_bytes": workspace_bytes,
    }
    RESULTS.joinpath("integrations.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# Lightning: BatchSizeFinder beside AutotuneBatchSize",
        "",
        f"{meta['machine']}. Produced by `bench/integrations.py`. The same LightningModule "
        f"({meta['module']}), AdamW, fp32, on an emulated GPU whose caching allocator gets "
        f"{CAPACITY_BYTES // 2**20} MiB; target global batch {TARGET_GLOBAL_BATCH}. "
        "BatchSizeFinder runs inside the simulated CUDA device (its OOM is torch's message, "
        "which Lightning catches); AutotuneBatchSize measures on the emulated GPU of the same "
        f"capacity less the cuBLAS workspaces ({workspace_bytes // 2**20} MiB) the simulated "
        "card keeps in its allocator.",
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
        "A plain fit of one step on the simulated card at these batch sizes (after a warm-up "
        f"step at 2), trains: {auto['max_fits_on_card']}. The emulated GPU's probe and the "
        "simulated card's accounting differ where the two disagree (see the largest size).",
        "",
    ]
    RESULTS.joinpath("integrations.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
