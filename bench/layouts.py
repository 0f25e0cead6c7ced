"""`sharding: auto` on large models: which layout the tuner chooses, and every layout's speed.

For Llama-3-8B and Llama-3-70B at sequence 4096 (bf16 autocast), full fine-tuning (fp32 master
weights, AdamW) and LoRA (r 16 on every linear layer, bf16 base weights), on one node of
8 H100s and on 4 nodes x 8 H100s joined at 400 and at 50 Gb/s per node, `tune --estimate`'s
layout choice (`autotune.engine.layout_tuning.tune_layouts` on `EstimateRunner`s): the chosen
layout, each layout's best samples/s per GPU and for the job, its compute and exposed
communication per step, and the estimate's wall time on this machine. The target is 512
samples (2M tokens) per optimizer step; the search cap is 16 per GPU.

    .venv/bin/python bench/layouts.py [--cells NAME ...] [--trials N] [--processes N] [--render]

Cells are named MODEL/MODE/TOPOLOGY (e.g. Llama-3-8B/lora/1x8); each run keeps the committed
rows of the other cells. `--processes N` tunes N layouts at a time, each in a process of its
own (`tune --estimate --processes N`); a cell's CPU time is then its processes' together, and
only one at a time records each layout's. Each row records this machine's speed too: the CPU
seconds of one case of `bench/estimator.py --speed` (`MACHINE_CASE`), run once as the script
starts. Writes bench/results/layouts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import Sharding, Spec, TuneResult
from autotune.engine.estimate import EstimateRunner
from autotune.engine.layout_tuning import tune_layouts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimator import LARGE_MODELS  # noqa: E402  (the published configs, one place)

RESULTS = Path(__file__).resolve().parent / "results"
GPU = "H100 80GB"
SEQ_LEN = 4096
TARGET_SAMPLES = 512
MODELS = ("Llama-3-8B", "Llama-3-70B")
MODES: dict[str, dict[str, Any]] = {
    "full": {"weights": "fp32", "optimizer": "adamw"},
    "lora": {"weights": "bf16", "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}},
}
TOPOLOGIES: dict[str, dict[str, Any]] = {
    "1x8": {"world_size": 8},
    "4x8@400": {"nodes": 4, "gpus_per_node": 8, "inter_node_gbps": 400},
    "4x8@50": {"nodes": 4, "gpus_per_node": 8, "inter_node_gbps": 50},
}


def cell_names() -> list[str]:
    return [f"{m}/{mode}/{t}" for m in MODELS for mode in MODES for t in TOPOLOGIES]


def cell_spec(name: str) -> Spec:
    model, mode, topology = name.split("/")
    training = {
        "seq_len": SEQ_LEN,
        "precision": "bf16",
        "sharding": "auto",
        "target_global_batch": TARGET_SAMPLES,
        "max_micro_batch": 16,
        **MODES[mode],
        **TOPOLOGIES[topology],
    }
    return Spec.model_validate({"model": {"hf_config": LARGE_MODELS[model]}, "training": training})


def _children_cpu_s() -> float:
    """The CPU seconds of this process's children that ended (the layouts' processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# What measures this machine's speed: one case of bench/estimator.py's speed part (a whole
# 8B `tune --estimate`, one core), run once per invocation in a child of its own. The machines
# these rows were made on differed by 2.5 times in it (its rows in estimator_speed.md), more
# than most changes to the estimate take off: a cell's seconds are read beside it.
MACHINE_CASE = "llama8b-lora-tune"


def machine_case_cpu_s() -> float:
    """The CPU seconds of `MACHINE_CASE` on this machine, now."""
    command = [sys.executable, str(Path(__file__).resolve().parent / "estimator.py")]
    done = subprocess.run(
        [*command, "--speed-case", MACHINE_CASE], capture_output=True, text=True, check=True
    )
    return round(float(json.loads(done.stdout.strip().splitlines()[-1])["cpu_s"]), 1)


def run_cell(
    name: str, trials: int | None, storage_url: str, processes: int, machine_cpu_s: float
) -> dict[str, Any]:
    spec = cell_spec(name)
    load = os.getloadavg()[0]
    started = time.monotonic()
    cpu_started = time.process_time()
    children_started = _children_cpu_s()

    def open_layout(layout: Spec) -> tuple[EstimateRunner, None]:
        budget = budget_for(find_gpu(GPU), layout.training.world_size)
        return EstimateRunner(layout, gpu=budget), None

    # Each layout's CPU seconds: from its start to the next layout's (or the end).
    layout_started: list[tuple[str, float]] = []

    def on_layout(sharding: Sharding, index: int, count: int) -> None:
        layout_started.append((sharding.value, time.process_time()))
        # A 70B cell's layouts take minutes each: say which one is running.
        # Side by side this process only relays: the wall clock says how far the cell is.
        so_far = (
            f"{time.process_time() - cpu_started:.0f} CPU s"
            if processes == 1
            else f"{time.monotonic() - started:.0f} s of wall"
        )
        print(  # noqa: T201 (a script's progress)
            f"  layout {index + 1} of {count}: {sharding.value} ({so_far} so far)",
            file=sys.stderr,
            flush=True,
        )

    result: TuneResult = tune_layouts(
        spec,
        open_layout,
        storage_url=storage_url,
        n_trials=trials,
        on_layout=on_layout,
        processes=processes,
    )
    wall_s = time.monotonic() - started
    cpu_s = time.process_time() - cpu_started + _children_cpu_s() - children_started
    ends = [at for _, at in layout_started[1:]] + [time.process_time()]
    # One at a time, a layout's CPU seconds are this process's from its start to the next
    # one's; side by side they are its child's, which this process does not see.
    layout_cpu_s = (
        {name: round(end - at, 1) for (name, at), end in zip(layout_started, ends, strict=True)}
        if processes == 1
        else None
    )
    rec = result.recommendation
    return {
        "cell": name,
        "world_size": spec.training.world_size,
        "chosen": rec.sharding.value if rec is not None and rec.sharding else None,
        "estimate_wall_s": round(wall_s, 1),
        "estimate_cpu_s": round(cpu_s, 1),
        "processes": processes,
        "layout_cpu_s": layout_cpu_s,
        "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
        "commit": CODE_COMMIT,
        "machine_case_cpu_s": machine_cpu_s,
        "trials_per_layout": trials,
        "layouts": [
            {
                "layout": layout.sharding.value,
                "verdict": layout.verdict.value,
                "max_micro_batch": layout.max_micro_batch,
                "max_micro_batch_checkpointed": layout.max_micro_batch_checkpointed,
                "best": None
                if layout.recommendation is None
                else {
                    "micro_batch": layout.recommendation.micro_batch,
                    "accumulation_steps": layout.recommendation.accumulation_steps,
                    "checkpointing": layout.recommendation.checkpointing_label,
                    "samples_per_s_per_gpu": layout.recommendation.samples_per_s,
                    "samples_per_s_job": layout.recommendation.job_samples_per_s,
                    "tokens_per_s_job": layout.recommendation.job_tokens_per_s,
                    "peak_gib": round(layout.recommendation.peak_bytes / 2**30, 2),
                },
                "compute_s": layout.compute_time_s,
                "exposed_communication_s": layout.exposed_communication_s,
                "communication_s": layout.communication_time_s,
                "reason": layout.reason,
            }
            for layout in result.layouts
        ],
    }


def _commit() -> str:
    """The commit of the code this process runs, read as it starts (with `+` when the work
    tree's tracked code differed from it; the results this script writes do not count)."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+" if dirty else "")


CODE_COMMIT = _commit()  # at import: the code every cell of this process runs

# A published multi-GPU training throughput to set beside the estimates.
TORCHTITAN_TOKENS_PER_S_PER_GPU = 5762
COMPARISON = """## A published figure beside it

pytorch/torchtitan, its performance page (performance.md in its docs folder), Table 1:
Llama 3.1 8B, 1D parallelism (FSDP2 full shard) on 8 H100s (96 GB HBM2e at the default
500 W power limit, NVLink within the host), local batch 2, global batch 16, selective
activation checkpointing, bf16 mixed precision:
**5,762 tokens/s per GPU** (46,096 for the 8 GPUs), 82.4 GiB of memory; 6,667 with
torch.compile. Its sequence length is torchtitan's Llama 3 8B default (8192), twice this
bench's, and its GPUs run at 500 W, not 700: compare orders of magnitude, not percent. The
row to set beside it is Llama-3-8B/full/1x8's zero3 tokens/s per GPU (the job's figure / 8)."""


def _cpu(row: dict[str, Any]) -> str:
    cpu_s = row.get("estimate_cpu_s")
    if cpu_s is None:
        return "CPU time not recorded"
    processes = row.get("processes", 1)
    side_by_side = f" in {processes} processes, layouts side by side" if processes > 1 else ""
    return f"{cpu_s:.0f} s of CPU{side_by_side}"


def _layout_cpu(row: dict[str, Any]) -> str:
    """Each layout's CPU seconds, in the order they ran, when recorded (the layout's model
    build, warm-up, trials and speed passes; the first layout's includes the imports the
    estimate makes on first use)."""
    by_layout = row.get("layout_cpu_s")
    if not by_layout:
        return ""
    return " CPU by layout: " + ", ".join(f"{k} {v:.1f} s" for k, v in by_layout.items()) + "."


def _machine(row: dict[str, Any]) -> str:
    """How fast the machine was, when recorded: the CPU seconds of `MACHINE_CASE` there."""
    cpu_s = row.get("machine_case_cpu_s")
    if cpu_s is None:
        return ""
    return (
        f" The machine's speed: {MACHINE_CASE} of bench/results/estimator_speed.md in "
        f"{cpu_s:.1f} CPU s."
    )


def _load(row: dict[str, Any]) -> str:
    """The load average as the cell started, and as it ended when recorded."""
    load = row["load_average"]
    return f"{load[0]} to {load[1]}" if isinstance(load, list) else str(load)


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# sharding: auto on large models (bench/layouts.py)",
        "",
        f"Estimates for {GPU} at sequence {SEQ_LEN}, bf16 autocast, target {TARGET_SAMPLES} "
        f"samples per optimizer step, search cap 16 per GPU. Machine: {meta['machine']}; "
        f"torch {meta['torch']}.",
        "",
        "Samples/s are the roofline of the traced step plus the exposed part of the layout's "
        "communication (NCCL's ring/tree model, docs/design.md#communication): per GPU, and "
        "for the job (every GPU). Compute and exposed communication are per optimizer step.",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
    ]
    for row in rows:
        lines += [
            f"## {row['cell']} ({row['world_size']} GPUs): chosen {row['chosen']}",
            "",
            f"Estimate: {row['estimate_wall_s']:.0f} s wall, {_cpu(row)} at load average "
            f"{_load(row)} on commit {row.get('commit', 'not recorded')}."
            + _layout_cpu(row)
            + _machine(row),
            "",
            "| layout | verdict | max micro-batch (plain / ckpt) | best | samples/s per GPU "
            "| samples/s job | tokens/s job | compute s | exposed comm. s | memory per GPU GiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layout in row["layouts"]:
            best = layout["best"]
            ckpt = layout["max_micro_batch_checkpointed"]
            lines.append(
                f"| {layout['layout']} | {layout['verdict']} | {layout['max_micro_batch']} / "
                f"{'-' if ckpt is None else ckpt} | "
                + (
                    "- | - | - | - | "
                    if best is None
                    else f"{best['micro_batch']} x {best['accumulation_steps']}, ckpt "
                    f"{best['checkpointing']} | {_number(best['samples_per_s_per_gpu'])} | "
                    f"{_number(best['samples_per_s_job'], 1)} | "
                    f"{_number(best['tokens_per_s_job'], 0)} | "
                )
                + f"{_number(layout['compute_s'], 3)} | "
                f"{_number(layout['exposed_communication_s'], 3)} | "
                + ("-" if best is None else f"{best['peak_gib']}")
                + " |"
            )
        lines.append("")
        for layout in row["layouts"]:
            lines.append(f"- {layout['layout']}: {layout['reason']}")
        lines.append("")
    missing = [name for name in cell_names() if name not in {row["cell"] for row in rows}]
    if missing:
        lines += ["## Not run", "", *(f"- {name}" for name in missing), ""]
    lines += [COMPARISON, "", *_beside_comparison(rows)]
    return "\n".join(lines)


def _beside_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """The estimate the published figure compares with: Llama-3-8B/full/1x8's zero3 row."""
    row = next((r for r in rows if r["cell"] == "Llama-3-8B/full/1x8"), None)
    layout = next((x for x in (row or {}).get("layouts", []) if x["layout"] == "zero3"), None)
    if row is None or layout is None or layout["best"] is None:
        return ["Here: Llama-3-8B/full/1x8 has no zero3 estimate yet.", ""]
    best = layout["best"]
    per_gpu = best["tokens_per_s_job"] / row["world_size"]
    return [
        f"Here, beside it: Llama-3-8B/full/1x8 zero3 (micro-batch {best['micro_batch']} x "
        f"{best['accumulation_steps']}, checkpointing {best['checkpointing']}, sequence "
        f"{SEQ_LEN}): **{per_gpu:,.0f} tokens/s per GPU** ({best['tokens_per_s_job']:,.0f} for "
        f"the {row['world_size']} GPUs), {best['peak_gib']} GiB per GPU: "
        f"{per_gpu / TORCHTITAN_TOKENS_PER_S_PER_GPU:.2f} times torchtitan's figure.",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="*", default=None, help="cells to run (default all)")
    parser.add_argument("--trials", type=int, default=None, help="measurements per layout")
    parser.add_argument(
        "--processes", type=int, default=1, help="layouts tuned at a time (default 1)"
    )
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    cells = args.cells or cell_names()
    json_path = RESULTS / "layouts.json"
    saved = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    if args.render:
        (RESULTS / "layouts.md").write_text(render(saved["rows"], saved["meta"]))
        return 0
    rows = {row["cell"]: row for row in saved["rows"]}
    storage = Path("/tmp") / f"autotune-bench-layouts-{os.getpid()}.db"
    machine_cpu_s = machine_case_cpu_s()
    print(  # noqa: T201 (a script's progress)
        f"this machine: {MACHINE_CASE} in {machine_cpu_s} CPU s", file=sys.stderr, flush=True
    )
    for name in cells:
        print(f"{name} ...", file=sys.stderr, flush=True)  # noqa: T201 (a script's progress)
        rows[name] = run_cell(
            name, args.trials, f"sqlite:///{storage}", args.processes, machine_cpu_s
        )
        ordered = [rows[n] for n in cell_names() if n in rows]
        meta = {
            **saved.get("meta", {}),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
        }
        json_path.write_text(json.dumps({"meta": meta, "rows": ordered}, indent=2) + "\n")
        (RESULTS / "layouts.md").write_text(render(ordered, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
