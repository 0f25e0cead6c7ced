"""What CUDA's autocast policy changes on the emulated GPU: peaks and maximum micro-batches.

For the zoo's small presets and two Hugging Face configs of the same size, in bf16 and fp16,
without and with checkpointing, this runs real steps on the emulated GPU twice: with torch's CPU
autocast lists (what the emulated GPU used before `autotune.engine.emulation.autocast`) and with
CUDA's policy. It reports the peak at a fixed micro-batch and the probe's maximum at one capacity,
and writes bench/results/autocast_policy.{json,md}.

    .venv/bin/python bench/autocast_policy.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import autotune.engine.training.step as step_module
from autotune.core.schemas import Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.probe import probe_mode
from autotune.engine.runner import InProcessRunner

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20
SEQ_LEN = 128
PEAK_AT = 8  # the fixed micro-batch whose peak is compared
CAPACITY_BYTES = 512 * MiB

HF_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 4,
    "n_embd": 256,
    "n_head": 4,
    "vocab_size": 8192,
    "n_positions": SEQ_LEN,
}
HF_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": SEQ_LEN,
}
MODELS: dict[str, dict[str, Any]] = {
    "hf gpt2 (4x256)": {"hf_config": HF_GPT2},
    "hf llama (4x256)": {"hf_config": HF_LLAMA},
    "gpt2-tiny": {"preset": "gpt2-tiny"},
    "llama-tiny": {"preset": "llama-tiny"},
    "cnn": {"preset": "cnn"},
    "mlp": {"preset": "mlp"},
}
TOKEN_MODELS = {"gpt2-tiny", "llama-tiny", "hf gpt2 (4x256)", "hf llama (4x256)"}


@contextlib.contextmanager
def cpu_lists() -> Iterator[None]:
    """The step without CUDA's policy: torch's CPU autocast lists, as before."""
    original = step_module.cuda_autocast_policy
    step_module.cuda_autocast_policy = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        step_module.cuda_autocast_policy = original


def spec_for(model: dict[str, Any], name: str, precision: str) -> Spec:
    training: dict[str, Any] = {"precision": precision, "max_micro_batch": 1024}
    if name in TOKEN_MODELS:
        training["seq_len"] = SEQ_LEN
    return Spec.model_validate({"model": model, "training": training})


def measure(name: str, precision: str, checkpointing: bool, policy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    spec = spec_for(MODELS[name], name, precision)
    runner = InProcessRunner(spec, EmulatedDevice(CAPACITY_BYTES))
    with cpu_lists() if policy == "cpu" else contextlib.nullcontext():
        runner.warm_up(checkpointing=checkpointing)
        peak = runner.trial(PEAK_AT, checkpointing=checkpointing)
        search = probe_mode(runner, checkpointing=checkpointing)
    return {
        "model": name,
        "precision": precision,
        "checkpointing": checkpointing,
        "policy": policy,
        "peak_bytes": peak.peak_bytes if peak.fits else None,
        "max_micro_batch": search.max_micro_batch,
    }


# Every model plain in both precisions; checkpointing where the policy changes something (the
# zoo's forward is op for op the same under both lists: tests/autotune_tests/engine/).
GRID = [
    *((name, precision, False) for name in MODELS for precision in ("bf16", "fp16")),
    *((name, "bf16", True) for name in ("hf gpt2 (4x256)", "hf llama (4x256)", "gpt2-tiny")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="bf16 without checkpointing only")
    args = parser.parse_args()
    grid = [row for row in GRID if not args.quick or row[1:] == ("bf16", False)]
    rows = []
    started = time.perf_counter()
    for name, precision, checkpointing in grid:
        pair = [measure(name, precision, checkpointing, p) for p in ("cpu", "cuda")]
        rows += pair
        print(name, precision, checkpointing, pair, file=sys.stderr)
    write(rows, time.perf_counter() - started)


def _change(cpu: float | None, cuda: float | None) -> str:
    if cpu is None or cuda is None or cpu == 0:
        return "n/a"
    return f"{100 * (cuda - cpu) / cpu:+.1f} %"


def write(rows: list[dict[str, Any]], seconds: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seq_len": SEQ_LEN,
        "peak_at_micro_batch": PEAK_AT,
        "capacity_bytes": CAPACITY_BYTES,
        "seconds": round(seconds),
    }
    (RESULTS / "autocast_policy.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    lines = [
        "# CPU autocast lists vs CUDA's policy on the emulated GPU",
        "",
        f"torch {meta['torch']}; sequence {SEQ_LEN} for token models; peak at micro-batch "
        f"{PEAK_AT}; maximum on an emulated GPU of {CAPACITY_BYTES // MiB} MiB "
        "(live bytes). Generated by `bench/autocast_policy.py`.",
        "",
        "| model | precision | ckpt | peak, CPU lists (MiB) | peak, CUDA policy (MiB) | change "
        "| max, CPU lists | max, CUDA policy | change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cpu, cuda in zip(rows[::2], rows[1::2], strict=True):
        cpu_peak, cuda_peak = cpu["peak_bytes"], cuda["peak_bytes"]
        lines.append(
            f"| {cpu['model']} | {cpu['precision']} | {'yes' if cpu['checkpointing'] else 'no'} "
            f"| {cpu_peak / MiB if cpu_peak else float('nan'):.2f} "
            f"| {cuda_peak / MiB if cuda_peak else float('nan'):.2f} "
            f"| {_change(cpu_peak, cuda_peak)} "
            f"| {cpu['max_micro_batch']} | {cuda['max_micro_batch']} "
            f"| {_change(cpu['max_micro_batch'], cuda['max_micro_batch'])} |"
        )
    (RESULTS / "autocast_policy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
