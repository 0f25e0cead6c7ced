"""Estimates on fake tensors against the emulated GPU, and what an estimate costs.

Part 1, the zoo: for every preset, three capacities and both checkpointing modes, the probe run
as an estimate (`autotune.engine.estimate.EstimateRunner`: the step traced on fake tensors) and
as an emulated probe (the same step executed on the CPU), with the time each took, and the
estimate again under `PYTORCH_ALLOC_CONF=expandable_segments:True` (the allocator setting the
probe evaluates as a knob) beside the default allocator's. The goal is
an exact match on every row, and an estimate of a few seconds per mode. The emulated probe runs
twice: with its fit points run for real, and with them traced first
(`autotune.engine.fit_points`), counting the real trials each mode takes (goal: 2).

Part 2, large models: Hugging Face configs no CPU could run (7B-70B parameters), estimated for
an H100 80GB and an H200 141GB at sequence 4096 with full training (fp32 master weights, AdamW):
the time an estimate takes and where the step first runs out.

Part 3, a published figure: the activation memory of Llama-3.1-8B at sequence 32768 measured by
stas00/ml-engineering, against the traced step's.

    .venv/bin/python bench/estimator.py [--quick | --large-only | --presets NAME ...
                                         | --expandable-column]

Writes bench/results/estimator.{json,md}.

Speed (`--speed`): what an estimate costs at the sizes people ask about, each case in a child
process of its own (its wall and CPU seconds, and its peak RSS, imports excluded from the times):
both modes of a 7B LoRA probe, a 70B LoRA probe under ZeRO-3 on 8 ranks, a whole `tune` of an 8B
LoRA, and one measurement at several accumulation counts. `--profile` adds the top entries of a
cProfile of the 7B probe. `--label before|after|replay|speed-replay` files the figures under
that label, keeping the other labels'. Writes bench/results/estimator_speed.{json,md} only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.presets import PRESETS
from autotune.core.schemas import Phase, ProbeResult, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.fit_points import TracedFitPoints
from autotune.engine.probe import probe_session
from autotune.engine.runner import InProcessRunner

RESULTS = Path(__file__).resolve().parent / "results"
HUGE_BYTES = 1 << 40
EXPANDABLE = AllocatorConfig(expandable_segments=True)
SEQ_LEN = 32
# Capacities where the plain step fits about this many samples (from the b = 2 and 8 peaks).
EXTRA_SAMPLES = (1, 4, 9)

LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
# Published configs (the models' config.json on the Hugging Face hub), the fields that size them.
LARGE_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3-8B": LLAMA_3_8B,
    "Mistral-7B-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "Qwen2.5-14B": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "Llama-3-70B": {
        **LLAMA_3_8B,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}


def preset_spec(name: str) -> Spec:
    training: dict[str, object] = {"max_micro_batch": 64, "precision": "bf16"}
    if PRESETS[name].kind == "decoder":
        training["seq_len"] = SEQ_LEN
    return Spec.model_validate({"model": {"preset": name}, "training": training})


def capacities(spec: Spec) -> list[int]:
    runner = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    assert runner.warm_up().fits
    two, eight = runner.trial(2).peak_bytes, runner.trial(8).peak_bytes
    per_sample = max((eight - two) // 6, 1)
    return [two + per_sample * extra for extra in EXTRA_SAMPLES]


def _modes(result: ProbeResult) -> list[dict[str, Any]]:
    return [
        {
            "checkpointing": mode.checkpointing,
            "max": mode.max_micro_batch,
            "recommended": mode.recommended_micro_batch,
            "trials": len(mode.attempts),
            "runs_out_below": list(mode.runs_out_below),
        }
        for mode in result.modes
    ]


def zoo_row(name: str, capacity_bytes: int) -> dict[str, Any]:
    spec = preset_spec(name)
    torch.manual_seed(0)
    started = time.perf_counter()
    estimated = probe_session(EstimateRunner(spec, capacity_bytes=capacity_bytes))
    estimate_s = time.perf_counter() - started
    # The same estimate with PYTORCH_ALLOC_CONF=expandable_segments:True: the traced answer
    # under the allocator setting the probe evaluates as a knob.
    torch.manual_seed(0)
    started = time.perf_counter()
    expandable = probe_session(
        EstimateRunner(spec, capacity_bytes=capacity_bytes, allocator_config=EXPANDABLE)
    )
    expandable_s = time.perf_counter() - started
    torch.manual_seed(0)
    started = time.perf_counter()
    emulated = probe_session(InProcessRunner(spec, EmulatedDevice(capacity_bytes)))
    emulated_s = time.perf_counter() - started
    torch.manual_seed(0)
    started = time.perf_counter()
    runner = InProcessRunner(spec, EmulatedDevice(capacity_bytes))
    traced = probe_session(runner, tracer=TracedFitPoints(runner))
    traced_s = time.perf_counter() - started
    estimate_modes, emulated_modes = _modes(estimated), _modes(emulated)
    traced_modes = _modes(traced)
    answers = [{k: m[k] for k in ("max", "recommended")} for m in emulated_modes]
    # Where the two searches disagree, memory is not monotone in b there (each answer fitted and
    # its next size did not): find the largest size that fits by trials from the cap down.
    largest = {
        mode["checkpointing"]: largest_fitting(spec, capacity_bytes, mode["checkpointing"])
        for mode, other in zip(emulated_modes, traced_modes, strict=True)
        if mode["max"] != other["max"]
    }
    return {
        "preset": name,
        "capacity_bytes": capacity_bytes,
        "estimate": estimate_modes,
        "estimate_expandable_segments": _modes(expandable),
        "emulated": emulated_modes,
        "emulated_traced_fit": traced_modes,
        "exact": estimate_modes == emulated_modes,
        "traced_fit_agrees": [{k: m[k] for k in ("max", "recommended")} for m in traced_modes]
        == answers,
        "largest_fitting": {str(k).lower(): v for k, v in largest.items()},
        "estimate_s_per_mode": estimate_s / len(estimate_modes),
        "estimate_expandable_s_per_mode": expandable_s / len(expandable.modes),
        "emulated_s_per_mode": emulated_s / len(emulated_modes),
        "emulated_traced_fit_s_per_mode": traced_s / len(traced_modes),
    }


def largest_fitting(spec: Spec, capacity_bytes: int, checkpointing: bool) -> int:
    """The largest micro-batch <= the cap whose step fits, by emulated trials from the cap down
    (a size that runs out does so early in its step, so the sizes above the answer are quick)."""
    runner = InProcessRunner(spec, EmulatedDevice(capacity_bytes))
    assert runner.warm_up(checkpointing=checkpointing).fits
    for micro_batch in range(spec.training.max_micro_batch, 1, -1):
        if runner.trial(micro_batch, checkpointing=checkpointing).fits:
            return micro_batch
    return 1


def large_row(name: str, gpu: str) -> dict[str, Any]:
    spec = Spec.model_validate(
        {
            "model": {"hf_config": LARGE_MODELS[name]},
            "training": {"precision": "bf16", "seq_len": 4096, "max_micro_batch": 64},
        }
    )
    started = time.perf_counter()
    runner = EstimateRunner(spec, gpu=budget_for(find_gpu(gpu)))
    built_s = time.perf_counter() - started
    result = probe_session(runner)
    first = result.modes[0].attempts[0]
    return {
        "model": name,
        "gpu": gpu,
        "max": [mode.max_micro_batch for mode in result.modes],
        "first_trial_peak_gib": first.peak_bytes / 2**30,
        "first_trial_oom_phase": first.oom_phase.value if first.oom_phase else None,
        "build_s": built_s,
        "total_s": time.perf_counter() - started,
    }


# stas00/ml-engineering, training/performance/README.md, "activation memory": Llama-3.1-8B,
# bf16, batch 1, sequence 32768; working memory per layer 2 B x 28 copies x s x hidden (measured
# copies), checkpoints 2 B x layers x s x hidden, logits 4 B x s x vocab. Quoted totals: with
# gradient checkpointing 7 + 8 + 16 = 31 GiB, without 224 + 16 = 240 GiB. At the end of forward
# (before backward recomputes a layer) that is 7 + 16 = 23 GiB with checkpointing.
PUBLISHED_SOURCE = (
    "stas00/ml-engineering, training/performance/README.md (activation memory; Llama-3.1-8B, "
    "bf16 weights, batch 1, sequence 32768)"
)
# Why the two differ, from the traced step's largest live allocations (checked by hand).
PUBLISHED_NOTE = (
    "The two count different steps. The traced step keeps its residual stream in fp32 (autocast "
    "over fp32 master weights; the measured run had bf16 weights): its 32 checkpoints are "
    "4 B x 32768 x 4096 each, 16 GiB, where the source counts 2 B (8 GiB, quoted as 7). The "
    "source counts one fp32 copy of the logits (16 GiB); the step keeps for backward the bf16 "
    "logits (7.8 GiB), their fp32 upcast and cross-entropy's fp32 log-softmax (15.7 GiB each): "
    "39 GiB. Those two account for 55 of the 56 GiB with checkpointing. Without it, the layers' "
    "working memory is 276.6 - 39.2 = 237 GiB: 29.7 copies of 2 B x s x hidden per layer, "
    "against the 28 measured, the fp32 residual stream making the difference. A like-for-like "
    "check needs bf16 weights without a master copy, which autotune does not model yet."
)
PUBLISHED_GIB = {False: 240.0, True: 23.0}
LLAMA_31_8B = {
    **LLAMA_3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def _linear_params(config: dict[str, Any]) -> int:
    """Parameters of a Llama's matmul weights (what autocast keeps a bf16 copy of per step)."""
    hidden: int = config["hidden_size"]
    inter: int = config["intermediate_size"]
    kv: int = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    layers: int = config["num_hidden_layers"]
    vocab: int = config["vocab_size"]
    return layers * per_layer + hidden * vocab


def published_row(checkpointing: bool, seq_len: int = 32768) -> dict[str, Any]:
    """The traced step's live bytes at the end of forward above what it started from (weights
    and AdamW's state), less autocast's bf16 copies of the matmul weights (a run with bf16
    weights, as measured, has none): the activations backward starts from."""
    spec = Spec.model_validate(
        {
            "model": {"hf_config": LLAMA_31_8B},
            "training": {"precision": "bf16", "seq_len": seq_len, "max_micro_batch": 1},
        }
    )
    started = time.perf_counter()
    runner = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    assert runner.warm_up(checkpointing=checkpointing).fits
    step = runner.trial(1, checkpointing=checkpointing)
    assert step.series is not None
    start_bytes = min(step.series)
    autocast_copies_bytes = 2 * _linear_params(LLAMA_31_8B)
    forward_bytes = step.phase_peak_bytes[Phase.FORWARD] - start_bytes
    return {
        "checkpointing": checkpointing,
        "seq_len": seq_len,
        "published_gib": PUBLISHED_GIB[checkpointing],
        "forward_end_gib": forward_bytes / 2**30,
        "autocast_weight_copies_gib": autocast_copies_bytes / 2**30,
        "activations_gib": (forward_bytes - autocast_copies_bytes) / 2**30,
        "step_peak_gib": step.peak_bytes / 2**30,
        "trace_s": time.perf_counter() - started,
    }


def by_mode(modes: list[dict[str, Any]], checkpointing: str) -> dict[str, Any]:
    """The mode of `modes` whose checkpointing is "true" or "false"."""
    return next(m for m in modes if str(m["checkpointing"]).lower() == checkpointing)


# What replays of the rows found (27 Nov 2026; docs/design.md#expandable-segments-as-a-knob and
# #the-caching-allocator-on-the-emulated-gpu give the allocation steps).
EXPANDABLE_NOTE = (
    "These are traced answers, not trials: the probe verifies expandable segments with real "
    "trials only where the trace predicts a gain. Rerun after the model's expandable segments "
    "were checked against torch's rules (none changed): every answer, and every size below one "
    "that runs out, as before. The smaller answers are torch's rules at "
    "work, which the model follows (the allocator's `expandable_segments` rules in "
    "docs/design.md): in one segment, the holes best fit leaves serve only what fits them, and "
    "growing costs a whole 20 MiB page, where plain segments give a request of 10 MiB or more "
    "a segment of its own size. gpt2-tiny at 124.0 MiB plain, micro-batch 10: log-softmax's "
    "10 MiB gradient finds 5 MiB free in a hole and 7 at the end of the large pool's 60 MiB; "
    "growing by a page makes 136 MiB and no page is wholly free, so it runs out where the "
    "default allocator serves it from a 20 MiB segment's free 12 MiB. gpt2-mini at 360.0 MiB "
    "plain, micro-batch 1: the optimizer's 24 MiB square root of the embedding's second moment "
    "finds 18.4 MiB free in pieces of the 300 MiB large pool (2.6 at the end), and two pages "
    "make 364 MiB; the defaults give it a 24 MiB segment (peak 354 MiB), and checkpointed at "
    "12 the holes fall elsewhere (peak 346 MiB). mlp at 42.0 MiB checkpointed, where micro-batch "
    "1 runs out under the default allocator while 64 fits plain: the emulated GPU's placement "
    "of the residents (packed first into a fresh allocator), not a card's. Its recomputed bf16 "
    "copy of the second weight takes a free 2.8 MiB block whole, its bf16 gradient then leaves "
    "a 2 MiB hole, and the optimizer's 4 MiB square root finds 2.8, 2 and 3.9 MiB free and "
    "needs a third 20 MiB segment; replayed in a card's order (the Adam state made in the "
    "warm-up's optimizer step, after its gradients), checkpointed 1 and 64 fit in 42 MiB. "
    "Placing the residents as the warm-up placed them is not done yet."
)


def default_beside_expandable(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The default allocator's estimate made by the same code as the row's estimate under
    expandable segments: the zoo run's own, or the one `--expandable-column` reran beside it
    (None: not run yet)."""
    if "expandable_load_average" not in row and "estimate_expandable_segments" in row:
        modes: list[dict[str, Any]] = row["estimate"]
        return modes
    return row.get("estimate_default_rerun")


def expandable_summary(rows: list[dict[str, Any]]) -> list[str]:
    """What the traced answers under expandable segments say against the default allocator's,
    counted over every mode of every row (lines of the results' text)."""
    defaults = {id(row): default_beside_expandable(row) for row in rows}
    done = [row for row in rows if defaults[id(row)] is not None]
    if not done:
        return []
    pairs = [
        (row, default, expandable)
        for row in done
        for default, expandable in zip(
            defaults[id(row)] or [], row["estimate_expandable_segments"], strict=True
        )
    ]
    changed = sum(
        [m["max"] for m in defaults[id(row)] or []] != [m["max"] for m in row["estimate"]]
        for row in done
    )
    higher = [(row, d, e) for row, d, e in pairs if e["max"] > d["max"]]
    lower = [(row, d, e) for row, d, e in pairs if e["max"] < d["max"]]
    expandable_dips = [(row, d, e) for row, d, e in pairs if e["runs_out_below"]]
    default_dips = [(row, d, e) for row, d, e in pairs if d["runs_out_below"]]
    removed = [(row, d, e) for row, d, e in default_dips if not e["runs_out_below"]]
    expandable_s = [row["estimate_expandable_s_per_mode"] for row in done]
    loads = [row["expandable_load_average"] for row in done if "expandable_load_average" in row]

    def named(items: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]) -> str:
        return "; ".join(
            f"{row['preset']} at {row['capacity_bytes'] / 2**20:,.1f} MiB "
            f"{'ckpt' if d['checkpointing'] else 'plain'} {d['max']} -> {e['max']}"
            for row, d, e in items
        )

    lines = [
        "Estimate with `PYTORCH_ALLOC_CONF=expandable_segments:True` beside the default "
        "allocator's, both made by the same code (the last two columns; the "
        "expandable one in bold where it differs"
        + (f"; {len(done)} of the {len(rows)} rows, '-': not run" if len(done) < len(rows) else "")
        + f"): of {len(pairs)} modes, a larger "
        f"answer on {len(higher)}"
        + (f" ({named(higher)})" if higher else "")
        + f", a smaller one on {len(lower)}"
        + (f" ({named(lower)})" if lower else "")
        + f", the same on {len(pairs) - len(higher) - len(lower)}. Modes with sizes below the "
        f"answer that run out: {len(default_dips)} under the default allocator ({len(removed)} "
        f"of them with none under expandable segments), {len(expandable_dips)} under expandable "
        "segments. Time per mode of the expandable estimate "
        f"(wall): median {statistics.median(expandable_s):.1f} s, max {max(expandable_s):.1f} s.",
        "",
    ]
    lines += [EXPANDABLE_NOTE, ""]
    if loads:
        lines += [
            "These two columns were added to the committed rows by "
            "`bench/estimator.py --expandable-column` (those two estimates alone, at each row's "
            f"capacity), under a load average of {min(loads):.0f}-{max(loads):.0f} on the 2 "
            "shared cores: its times are wall seconds under that load; every other column is "
            f"the committed run's, made by older code: the rerun default estimate's maxima differ "
            f"from the committed ones on {changed} of {len(done)} rows, so compare expandable "
            "segments with the rerun.",
            "",
        ]
    return lines


def expandable_column() -> int:
    """The estimate under expandable segments for each committed zoo row, with the default
    allocator's estimate rerun beside it by the same code (the committed estimate column may
    be older), added to its committed columns (the whole zoo takes hours on a loaded shared
    machine; this is its cheapest part). A row that has either already keeps it."""
    committed = json.loads((RESULTS / "estimator.json").read_text())
    rows: list[dict[str, Any]] = committed["zoo"]
    for row in rows:
        spec = preset_spec(row["preset"])
        for key, config in (
            ("estimate_expandable_segments", EXPANDABLE),
            ("estimate_default_rerun", None),
        ):
            if key in row:
                continue
            torch.manual_seed(0)
            started = time.perf_counter()
            result = probe_session(
                EstimateRunner(spec, capacity_bytes=row["capacity_bytes"], allocator_config=config)
            )
            row[key] = _modes(result)
            if config is not None:
                row["estimate_expandable_s_per_mode"] = (time.perf_counter() - started) / len(
                    result.modes
                )
                row["expandable_load_average"] = os.getloadavg()[0]
            print(json.dumps({"preset": row["preset"], key: row[key]}), flush=True)
            _write(rows, committed["large"], committed["published"])
    return 0


PLACEMENT_NOTE = (
    "Every row of the table above was rerun on 27 Nov 2026 with the residents placed where the "
    "warm-up left them (docs/design.md#the-caching-allocator-on-the-emulated-gpu); the rows "
    "before it packed them first, as do the large models' and the published figure's rows "
    "below (not rerun). mlp, gpt2-tiny and llama-tiny show one capacity three times: with the "
    "residents placed, their steps at micro-batch 2 and 8 reserve the same bytes, so "
    "`capacities` (which spaces the three by the reserved bytes per sample between 2 and 8) "
    "steps by 1 byte. Spacing them by allocated bytes instead would give three capacities "
    "again and change every row; not done in this rerun."
)


def _write(
    rows: list[dict[str, Any]],
    large: list[dict[str, Any]],
    published: list[dict[str, Any]] | None = None,
) -> None:
    RESULTS.mkdir(exist_ok=True)
    document = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}",
        "zoo": rows,
        "large": large,
        "published": published or [],
    }
    (RESULTS / "estimator.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        "# Estimates on fake tensors vs the emulated GPU",
        "",
        f"Made by `bench/estimator.py` on {document['machine']}. bf16, AdamW, sequence "
        f"{SEQ_LEN} for the decoders; three capacities per preset.",
        "",
        "| preset | capacity (MiB) | estimate: max plain / ckpt | emulated: max plain / ckpt "
        "| exact | estimate s/mode | emulated s/mode | real trials per mode: fit run / fit traced "
        "| traced agrees | emulated, fit traced s/mode | estimate beside expandable segments: "
        "default allocator | estimate, expandable segments |",
        "|---|---:|---|---|---|---:|---:|---|---|---:|---|---|",
    ]
    for row in rows:

        def maxima(modes: list[dict[str, Any]]) -> str:
            return " / ".join(str(mode["max"]) for mode in modes)

        def expandable_maxima(row: dict[str, Any]) -> str:
            # Bold where expandable segments change the traced answer.
            if "estimate_expandable_segments" not in row:
                return "-"
            defaults = default_beside_expandable(row) or row["estimate_expandable_segments"]
            return " / ".join(
                f"**{mode['max']}**" if mode["max"] != default["max"] else str(mode["max"])
                for mode, default in zip(
                    row["estimate_expandable_segments"], defaults, strict=True
                )
            )

        def trials(modes: list[dict[str, Any]]) -> str:
            return " + ".join(str(mode["trials"]) for mode in modes)

        lines.append(
            f"| {row['preset']} | {row['capacity_bytes'] / 2**20:,.1f} | "
            f"{maxima(row['estimate'])} | {maxima(row['emulated'])} | "
            f"{'yes' if row['exact'] else '**no**'} | {row['estimate_s_per_mode']:.1f} | "
            f"{row['emulated_s_per_mode']:.1f} | {trials(row['emulated'])} / "
            f"{trials(row['emulated_traced_fit'])} | "
            f"{'yes' if row['traced_fit_agrees'] else '**no**'} | "
            f"{row['emulated_traced_fit_s_per_mode']:.1f} | "
            f"{maxima(default_beside_expandable(row) or []) or '-'}"
            f" | {expandable_maxima(row)} |"
        )
    exact = sum(row["exact"] for row in rows)
    agrees = sum(row["traced_fit_agrees"] for row in rows)
    dips = [
        f"{row['preset']} at {row['capacity_bytes'] / 2**20:,.1f} MiB, checkpointing {mode}: "
        f"fit run {by_mode(row['emulated'], mode)['max']}, fit traced "
        f"{by_mode(row['emulated_traced_fit'], mode)['max']}, largest that fits {largest}"
        for row in rows
        for mode, largest in row["largest_fitting"].items()
    ]
    untraced = [m["trials"] for row in rows for m in row["emulated"]]
    traced = [m["trials"] for row in rows for m in row["emulated_traced_fit"]]
    estimate_s = [row["estimate_s_per_mode"] for row in rows]
    expandable = expandable_summary(rows)
    lines += [
        "",
        PLACEMENT_NOTE,
        "",
        f"Estimate equal to the emulated probe on {exact} of {len(rows)} rows; the emulated "
        f"probe with a traced fit equal to it on {agrees} of {len(rows)}.",
        "",
        f"Real trials per mode (an attempt at micro-batch 1 only: nothing fits): fit points run, "
        f"median {statistics.median(untraced):g}, max {max(untraced)}; fit points traced, "
        f"median {statistics.median(traced):g}, max {max(traced)}.",
        "",
        f"Estimate time per mode: median {statistics.median(estimate_s):.1f} s, max "
        f"{max(estimate_s):.1f} s.",
        "",
        *expandable,
    ]
    if dips:
        lines += [
            "Where the two emulated probes differ, memory is not monotone in the micro-batch "
            "(the optimizer step's allocations fragment the cache differently at each size, so "
            "some sizes run out there while larger ones fit); each answer fitted and its next "
            "size did not. The largest size that fits, by trials from the cap down:",
            "",
            *[f"- {dip}" for dip in dips],
            "",
        ]
    if large:
        lines += [
            "## Large models (full training: fp32 weights, AdamW; sequence 4096)",
            "",
            "| model | GPU | max plain / ckpt | first trial's peak (GiB) | ran out in | "
            "build (s) | total (s) |",
            "|---|---|---|---:|---|---:|---:|",
        ]
        for row in large:
            lines.append(
                f"| {row['model']} | {row['gpu']} | {' / '.join(map(str, row['max']))} | "
                f"{row['first_trial_peak_gib']:,.1f} | {row['first_trial_oom_phase'] or '-'} | "
                f"{row['build_s']:.1f} | {row['total_s']:.1f} |"
            )
        lines.append("")
    if published:
        lines += [
            "## A published figure: Llama-3.1-8B activations at sequence 32768",
            "",
            f"Source: {PUBLISHED_SOURCE}. Estimated: the traced step (bf16 autocast over fp32 "
            "master weights, AdamW, SDPA) at batch 1, its live bytes at the end of forward above "
            "the weights and optimizer state, less autocast's bf16 copies of the matmul weights.",
            "",
            "| checkpointing | published (GiB) | estimated activations (GiB) | error | autocast "
            "weight copies (GiB) | step's peak reserved (GiB) | trace (s) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in published:
            error = row["activations_gib"] / row["published_gib"] - 1
            lines.append(
                f"| {'yes' if row['checkpointing'] else 'no'} | {row['published_gib']:.0f} | "
                f"{row['activations_gib']:.1f} | {error:+.0%} | "
                f"{row['autocast_weight_copies_gib']:.1f} | {row['step_peak_gib']:.1f} | "
                f"{row['trace_s']:.1f} |"
            )
        lines += ["", PUBLISHED_NOTE, ""]
    (RESULTS / "estimator.md").write_text("\n".join(lines))


SPEED_JSON = RESULTS / "estimator_speed.json"
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
QWEN2_5_0_5B = {
    **QWEN2_7B,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}
LORA_64 = {"r": 64, "target_modules": "all-linear"}
# name -> (what it is, model config, training fields, GPU, what runs: probe | tune | accumulation)
SPEED_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], str, str]] = {
    "qwen7b-lora-probe": (
        "Qwen2-7B, LoRA r 64 all linear, bf16 weights, seq 4096: `probe --estimate` both modes",
        QWEN2_7B,
        {"weights": "bf16", "lora": LORA_64},
        "A100 80GB",
        "probe",
    ),
    "llama70b-lora-zero3-probe": (
        "Llama-3-70B, LoRA r 64 all linear, bf16 weights, ZeRO-3 on 8 ranks, seq 4096: "
        "`probe --estimate` both modes",
        LARGE_MODELS["Llama-3-70B"],
        {"weights": "bf16", "lora": LORA_64, "sharding": "zero3", "world_size": 8},
        "H100 80GB",
        "probe",
    ),
    "llama70b-lora-zero3-tune": (
        "Llama-3-70B, LoRA r 16 alpha 32 all linear, bf16 weights, ZeRO-3 on 8 ranks, seq 4096, "
        "target 512 samples, search cap 16, 2 measurements: a whole `tune --estimate` (the "
        "zero3 layout of bench/layouts.py's Llama-3-70B/lora/1x8 with --trials 2)",
        LARGE_MODELS["Llama-3-70B"],
        {
            "weights": "bf16",
            "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
            "sharding": "zero3",
            "world_size": 8,
            "target_global_batch": 512,
            "max_micro_batch": 16,
        },
        "H100 80GB",
        "tune",
    ),
    "llama8b-lora-tune": (
        "Llama-3-8B, LoRA r 64 all linear, bf16 weights, seq 4096, target 64 samples: a whole "
        "`tune --estimate`",
        LLAMA_3_8B,
        {"weights": "bf16", "lora": LORA_64, "target_global_batch": 64},
        "A100 80GB",
        "tune",
    ),
    "qwen0.5b-accumulation": (
        "Qwen2.5-0.5B full fine-tune, seq 4096, micro-batch 1: one measurement (trial and "
        "roofline) at G = 1, 8, 64 and 2^20",
        QWEN2_5_0_5B,
        {},
        "A100 80GB",
        "accumulation",
    ),
    "small-llama-lora-tune": (
        "a 4-layer Llama (hidden 512), LoRA r 16 all linear, seq 4096, target 256 samples, on a "
        "T4: a whole `tune --estimate`, counting the traced steps (the same on any machine)",
        {
            "model_type": "llama",
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
        {"lora": {"r": 16, "target_modules": "all-linear"}, "target_global_batch": 256},
        "T4",
        "tune",
    ),
}
# A tune's measurement budget where a case sets one (else the tuner's default).
TUNE_TRIALS = {"llama70b-lora-zero3-tune": 2}
ACCUMULATIONS = (1, 8, 64, 2**20)
# Rows by round: before and after the reuse of traces, after the layer replay, and after its
# speed passes (round 3).
SPEED_LABELS = (
    "before",
    "after",
    "replay",
    "speed-replay",
    "bytecode",
    "ckpt-replay",
    "sharded-replay",
    "oom-replay",
    "tune-speed",
    "microstep",
    "probe70b",
    "quiet",
    "trace-share",
    "fake-cache",
    "tune70b",
    "merged",
    "quiet2",
    "warm-init",
    "foreach",
    "search-ahead",
    "quiet3",
    "trace-key",
    "quiet4",
    "no-full-gc",
    "fast-build",
    "machine40",
    "session40",
    "session42",
)
# Read off the profiles below by hand (the "before" one: 416 profiled seconds, from a cProfile
# of the same case at 88cac00 run apart from the bench, whose own profile's table was garbled).
SPEED_NOTES = [
    "Where the seconds go, 7B LoRA probe: the 7 traced steps (a warm-up, 2 trials without "
    "checkpointing, 4 with) are 93 % of the time, the model's build with its adapters most of "
    "the rest. Each traced step is about 41,000 aten ops (288,846 tracker calls over 7 steps), "
    "and about 80 % of an op's cost is fake-tensor dispatch inside torch: the cache key "
    "(`_prep_args_for_hash`, `extract_tensor_metadata`), outputs rebuilt from the cache entry "
    "(`_get_output_tensor_from_cache_entry`, `FakeTensor.__new__`) and the dynamo-disable "
    "wrapper around every dispatch mode (600,000 calls). The live-byte tracker and the "
    "allocator model are a few percent; the FLOP counter runs only in speed passes, which a "
    "probe has none of.",
    "`builtins.compile` (24 of 416 profiled seconds, about 6 %) is this sandbox's: it sets "
    "PYTHONDONTWRITEBYTECODE=1, so the modules an estimate imports lazily (the transformers "
    "model, peft) are compiled from source in every run, before and after alike; an installed "
    "package has its bytecode.",
    "What changed: a warm EstimateRunner answers a trial or speed pass it traced before from "
    "that trace (the tuner asks for the probe's sizes and the G = 2 probe's again when it "
    "measures them), and the speed pass traces one step of 3 micro-steps, its middle one "
    "standing for every other, instead of steps of 2 and 3 (5 micro-steps). A probe traces "
    "what it did before (no trial repeats within a probe): its cost is unchanged.",
    "The committed rows (26 Nov 2026): small-llama-lora-tune's after row ran at 51962f4, "
    "before 847dbcd added a middle micro-step's token count to its time (about 1.5e-5 s per "
    "middle micro-step: samples/s differ in the fifth digit; the cost is the same); at 847dbcd "
    "the accumulation row's step times equal the before row's to 1e-11. Its G = 64 and 2^20 "
    "are answered from the traces of G = 8 (a trial traces min(G, 5) micro-steps, a speed pass "
    "3). The after profile's table lost the numbers of its recursive rows (a bug of the bench, "
    "fixed since). llama70b-lora-zero3-probe and llama8b-lora-tune did not finish on this box "
    "at load 18 in the time given (the 8B tune ran over 25 minutes of wall time before and was "
    "stopped); the traced-step counts of small-llama-lora-tune stand for what the reuse saves "
    "a tune, and its answers are equal.",
    "Round 1 (before, after): what is left were the goals (8 s for both modes of a 7B LoRA "
    "probe, 15 s for 70B), which need about 1/8 of the ops traced per step.",
    "Round 2 (replay), the layer replay (docs/design.md#the-layer-replay): a transformers "
    "decoder of 7 layers or more, on one rank, whose layers are all the same layer, is traced "
    "at 5 layers and each trial's journal of allocations, frees and ops is written out for its "
    "depth and replayed through the allocator model; tests compare every replayed trial with "
    "the whole model's trace to the byte. qwen7b-lora-probe: 18.4 CPU s instead of 67.5 (3.7x; "
    "its maxima and peaks are the before row's to the byte), at load 7.8. Where they go now "
    "(a cProfile of the same probe, 26 Nov 2026): the 5-layer traces about 75 % (9,400 ops "
    "per trial instead of 41,000: the embeddings, the 152k-token head and the loss are traced "
    "as before), writing out and replaying the 28-layer journal about 10 %, and the search's "
    "own replays of the allocation traces (its fit points) about 12 %. small-llama-lora-tune "
    "has 4 layers, fewer than the replay needs, and traces as before: its maxima and "
    "recommendation are the after row's, its samples/s the before row's to 1e-10 (the fifth "
    "digit the after row's note explains is back to the before row's on the main branch "
    "this round started from; not the replay's doing), and it traced one step more (21 "
    "against 20), for a reason in the same changes, not traced here; its CPU seconds differ "
    "with the machine's load (9.7 against 11.7).",
    "Goals after round 2: the 7B LoRA probe's 8 s is not met (18.4 CPU s). A 70B model under "
    "ZeRO-3 on 8 ranks is not replayed (several ranks are traced whole: sharded parameters' "
    "gathers are not journaled by layer) and was not run. A whole tune traces its speed "
    "passes on the whole model (built, and warmed up, when the first speed pass needs it), so "
    "a tune gains only its trials. Any accumulation count costs a constant (round 1). Peak RSS "
    "stays under 500 MiB in every row measured.",
    "llama8b-lora-tune finished this round (it had not in 25 minutes of wall time before, at "
    "load 18): 192.8 CPU s, 708 s of wall time at load 9.9, peak RSS 656 MiB; its probe's "
    "trials are replayed from 5 layers, its speed passes trace the whole 32-layer model (the "
    "traced steps count both models' steps). The goal of 30 s for a whole tune of an 8B "
    "model is not met; the speed passes are most of what is left of it.",
    "What is left: the speed pass by the same replay (a layer's kernel times repeat too, but "
    "an optimizer's foreach kernel spans every layer's parameters and its roofline time is not "
    "a sum over layers); several ranks (FSDP2's per-layer all-gathers and frees, DDP's "
    "buckets) in the journal; and the per-op cost of the 5-layer trace itself, now the bulk.",
    "Round 3 (speed-replay), the speed pass by the layer replay (docs/design.md#the-layer-replay, "
    "item 4; autotune/engine/replay/layer_speed.py): a replayed model's speed pass runs the "
    "5-layer "
    "model, files each kernel under its layer, counts the pure middle layer's kernels N - 4 "
    "times, and times each optimizer foreach kernel (one launch over every layer's tensors) "
    "once with the deep model's bytes. Tests compare it with the whole model's speed pass to "
    "1e-12 relative (measured: at most 3e-14 on the test configs; on Llama-3-8B LoRA at 4096 "
    "tokens, G = 3 and 64, 5e-14 and 8e-14, 2.4 CPU s for both passes against 11.4 whole).",
    "llama8b-lora-tune: 155.2 CPU s instead of 192.8 (load 6.1 against 9.9). Where the rest "
    "goes (a run of the same tune logging each call's CPU seconds, at 1c148c2 and at this "
    "round): its 15 replayed trials about 33 s, and partial checkpointing, which the replay "
    "does not cover (its first k layers differ from the others): the whole 32-layer model is "
    "built and warmed up (11 s) for the tuner's fewest-blocks search, 6 trials of 4 x 2 and "
    "4 x 5 at 16 to 28 blocks traced whole (88 s), and its speed pass of 25 blocks timed whole "
    "(14.5-18.5 s). The two replayed speed passes took 1.7 and 2.1 CPU s (26 and 18 whole).",
    "Its recommendation is the same configuration (1 x 64, no checkpointing); its samples/s "
    "differ (0.68339 against 0.68499): the step's history, not the replay. transformers' "
    "gradient_checkpointing_enable calls enable_input_require_grads, and "
    "gradient_checkpointing_disable undoes it only for transformers' own PEFT integration, not "
    "for a peft-wrapped model: after any checkpointed step, a plain step's embedding output "
    "requires a gradient and layer 0's backward computes its input's. The round-2 tune timed "
    "a whole model built for its first speed pass, which had run no checkpointed step; this "
    "round's times the 5-layer model, which ran the probe's checkpointed trials. The same "
    "history gives the same time both ways: after a checkpointed warm-up and a plain one, "
    "1 x 64 plain takes 93.651432597036 s replayed and 93.651432597044 s whole (the tune's "
    "figure), and 93.431586803023 s replayed and 93.431586803030 s whole after a plain "
    "warm-up only (round 2's). Both traces are exact for the step they run; which history a "
    "plain step should have is the step's question (training/workload.py's checkpointing "
    "switch), left for a change of its own. Fixed since on main (763c7a1): the checkpointing "
    "switch removes the hook it made when checkpointing goes off, so a plain step is the "
    "plain-only one whatever ran before (a test on a LoRA model checks the first layer's "
    "input); this row was not rerun after it: its samples/s would be round 2's history's, "
    "93.43 s per 1 x 64 step.",
    "qwen0.5b-accumulation (24 layers, full fine-tuning, AdamW): 9.8 CPU s instead of 41.8 "
    "(load 3.9 against 8.2); its step times are the after row's to 3e-14 and its peaks to the "
    "byte, its speed passes now from the 5-layer model.",
    "qwen7b-lora-probe: a probe has no speed pass; 21.7 CPU s against 18.4 (the same code "
    "path; the load and the sandbox's compile of lazily imported modules differ), the same "
    "answers to the byte.",
    "Bytecode (27 Nov 2026): two corrections of the bench, no change of autotune. (1) The "
    "speed part compiles transformers and peft before its cases (`_compile_lazily_imported`), "
    "as an installed package has its bytecode: this sandbox sets PYTHONDONTWRITEBYTECODE=1, so "
    "a module no earlier run had compiled was compiled from source inside a case (a cProfile of "
    "the 7B probe: `builtins.compile` 11.2 of 43.8 profiled seconds). (2) A case imports the "
    "model's transformers module and peft's LoRA tuner before its timer starts "
    "(`_import_what_the_case_builds`): they were imported lazily inside the build, against "
    "this table's rule that imports are in neither figure (about 3 CPU s of the 7B probe's; "
    "its build is now 0.3 s). qwen7b-lora-probe: **6.9 CPU s** (load 5.0), within the 8 s "
    "goal, the same answers to the byte as every earlier row. The command as a person runs it, "
    '`autotune probe SPEC --estimate "A100 80GB"` with this case\'s spec, imports included: '
    "13.5 CPU s (12.67 user + 0.83 system), 23.0 s of wall time at load 5, peak RSS 476 MiB; "
    "its imports (torch, transformers, peft, rich) are about 6.5 of those seconds. "
    "qwen0.5b-accumulation: 3.8 CPU s against 9.8, the same peaks; its step times 2.9 % lower, "
    "the _unsafe_view fix's (fed34a0).",
    "llama8b-lora-tune (bytecode row, the same code as speed-replay's plus the step-history fix "
    "763c7a1 and the _unsafe_view fix): 92.4 CPU s (load 3.4) against 155.2. The same "
    "configuration (1 x 64, no checkpointing, peak 55,444,504,576 B to the byte); samples/s "
    "0.70200 against 0.68339: a plain step no longer computes layer 0's input gradient after "
    "a checkpointed one (763c7a1), and each linear's reshape is no copy kernel (fed34a0). "
    "Partial checkpointing is still traced whole (the goal of 30 s is not met).",
    "Round 4 (ckpt-replay), partial checkpointing by the layer replay "
    "(docs/design.md#the-layer-replay; autotune/engine/replay/layer_plan.py): a trial or speed "
    "pass "
    "that checkpoints the first k of N layers runs an 8-layer model with its first few layers "
    "checkpointed (the two ends, a run of checkpointed and a run of plain middle layers, each "
    "shortened to 3 or traced at its own length) and writes its journal out for N layers, "
    "each shortened run's pure layer repeated; tests compare it with the whole model's trace "
    "to the byte and its speed pass to 1e-12 relative.",
    "llama8b-lora-tune: 48.8 CPU s instead of 155.2 (load 1.6 against 6.1; 49.1 s of wall "
    "time, peak RSS 637 MiB); the whole 32-layer model is never built. Where they go (the "
    "row's calls_cpu_s in estimator_speed.json: each warm-up, trial and speed pass the tuner "
    "asked for, in CPU seconds, answers from an earlier trace included): the model's build "
    "6.3 s, the warm-up 0.9 s, 11 trials replayed from 5 layers 16.5 s (0.5 to 4.2 each), the "
    "6 partial checkpointing trials replayed from 8 layers 17.3 s (2.1 to 5.3; the first, "
    "3.3 s, builds the 8-layer model and warms it up), two speed passes from 5 layers 3.0 s "
    "and the partial checkpointing one from 8 layers 2.4 s, and about 3 s of the tuner's own. "
    "Partial checkpointing took about 100-118 s of the speed-replay row (the whole model's "
    "build and warm-up, 6 trials traced whole, a speed pass timed whole) and takes 19.7 s "
    "here. The rest of the drop is not this change's: the 5-layer trials took about 33 s in "
    "that row, at load 6.1 and before main's changes since (the step-history fix 763c7a1, "
    "_unsafe_view launching no kernel fed34a0), which this run does not separate.",
    "Its answers are the speed-replay row's: the maxima, the recommended 1 x 64 without "
    "checkpointing and its peak to the byte. Its samples/s (0.70200 against 0.68339) is the "
    "plain 1 x 64 step's, timed from 5 layers, where this change replays as before (the "
    "speed-replay tests pass unchanged): main's changes since that row, the two named above. "
    "The goal of 30 CPU s for a whole tune of an 8B model is not met: the traced steps "
    "themselves are the bulk (33.8 s of trials from 5 and 8 layers), at the per-op cost of "
    "fake-tensor dispatch; what is left is that cost, or fewer traced layers (a 6-layer model "
    "for partial checkpointing would do if a layer between two of its kind were the "
    "composite of the layers next to the others, which is not checked today).",
    "Round 5 (sharded-replay row, commit 797355e plus the bench's corrections above): "
    "partial checkpointing and FSDP2's sharded ranks both replayed "
    "(docs/design.md#the-layer-replay), at load 5.7-5.8 on the 2 shared cores. "
    "llama8b-lora-tune: 43.6 CPU s (48.8 in "
    "the ckpt-replay row, which paid its lazy imports; 92.4 in the bytecode row, partial "
    "checkpointing traced whole), every call replayed (calls_cpu_s: 11 trials 16.8 s, 6 "
    "partial trials 18.0 s, 3 speed passes 5.8 s); the same answers to the byte. The 30 s goal "
    "is not met. llama70b-lora-zero3-probe, run for the first time: 66.4 CPU s (120 s of wall "
    "time, peak RSS 587 MiB); micro-batch 1 runs out without checkpointing (the plain mode's "
    "answer is 0), 4 fits with it (peak 81,124,130,816 B). Of its 66 s, 47.2 are its first "
    "trial, micro-batch 1 without checkpointing, which runs out: a sharded rank's "
    "out-of-memory is traced whole for its detail (which parameters FSDP2 has registered "
    "then; the journal does not record it), the 80-layer model built and traced; the other 5 "
    "trials and 2 warm-ups are replayed (1.3-6.0 s each). The 15 s goal is not met: it needs "
    "the out-of-memory detail from the replay.",
    "Round 6 (oom-replay row, commit b5083b1), at load 9.8 on the 2 shared cores: a sharded "
    "rank's out-of-memory detail comes from the replay too (the journal records FSDP2's swaps "
    "of shards and gathered parameters and the gathered parameters' gradients: "
    "docs/design.md#the-layer-replay), so no trial traces the 80-layer model. "
    "llama70b-lora-zero3-probe: 17.8 CPU s instead of 66.4, the same answers to the byte; its "
    "first trial (micro-batch 1 without checkpointing, which runs out) 1.35 s instead of 47.2. "
    "The 15 s goal is not met. Where the 17.8 s go (a run of the same probe timing each "
    "function's CPU seconds, 17.4 s in all): the 8 traced steps of the 5-layer model 11.5 s "
    "(2 warm-ups, 6 trials: fake-tensor dispatch, as in round 2), writing out the 80-layer "
    "journals 1.0 s and replaying them through the allocator model 1.2 s, the search's own "
    "replays of the 80-layer allocation traces (its fit points, the recommended micro-batch, "
    "the check that the replay is exact) 2.2 s and their predicted traces and live peaks 0.75 "
    "s, the build 0.6 s (the 80-layer model on the meta device, read by replay_depth, 0.07 s). "
    "Cut: the allocator model rounds each request size once (a deep step asks for a few "
    "hundred sizes tens of thousands of times): its replays 2.55 s before, 2.23 after. What "
    "is left is the traced steps' per-op cost, and the Python allocator model run over "
    "80-layer traces (about 3.4 s here).",
    "Round 7 (tune-speed row, 27 Nov 2026): llama8b-lora-tune, 44.8 CPU s at load 10.6, "
    "against 61.1 CPU s at load 10.2 for the code of the sharded-replay row (7479bd1, whose "
    "engine is f426b86's) run just before it on the same box (2 cores shared by four "
    "helpers' jobs): 27 % less, the same answers to the byte (maxima, 1 x 64 without "
    "checkpointing, samples/s 0.7019982546327984, peak 55,444,504,576 B), peak RSS 603 MiB "
    "against 591. That load inflates CPU seconds: the same code took 43.6 in the "
    "sharded-replay row at load 5.8, so this row stands for about 32 s there; the 30 s goal "
    "is not shown met. Two cuts (docs/design.md#the-layer-replay). (1) Partial "
    "checkpointing's counts share one shallow trace: the tuner's fewest-blocks search asks "
    "for 4 x 2 at 16, 24, 28, 26 and 25 of 32 blocks, and the 8-layer model runs each as the "
    "same step (its first 4 layers checkpointed, both deep runs shortened to 3), so once warm "
    "the traced model keeps its journals (and speed passes) by that step and writes each "
    "count out from one trace: partial trials 12.0 CPU s against 25.4 (4.4 for the first, "
    "the 8-layer model's build and warm-up included, then 0.2-0.6 against 2.9-3.5 each), 18 "
    "traced steps (40 micro-steps) against 22 (48). (2) The per-op path: torch wraps every "
    "dispatch mode's own __torch_dispatch__ in a guard against torch.compile (four "
    "eval-frame switches a call) and a fake tensor's device queries, two for each counted "
    "op, pass through every mode; the trackers and the kernel times opt out of the guard "
    "(nothing runs compiled) and the journal passes uncounted ops on directly, so the tune "
    "makes 3.5 times fewer guarded calls (434,610 against 1,509,564 in the profiles below): "
    "the 11 five-layer trials 20.5 CPU s against 22.8, the speed passes 7.6 against 8.0. "
    "Checked and not taken: a 6-layer model for partial checkpointing (partial_plan(6, 32, "
    "k) is NotReplayable for every k the tune asks, runs of 2 traced layers have no pure "
    "layer); one trace for a trial and the speed pass of one configuration (at G = 64 the "
    "trial traces 5 micro-steps and the speed pass 3, whose first micro-step makes 3 "
    "micro-batches, not 5: its kernel times would sum in another order, not to the byte); "
    "fake-tensor caching off (the 5-layer 2 x 1 checkpointed trace 1.64 CPU s against "
    "0.99); skipping the 8-layer model's warm-up (it makes the optimizer state and snapshot "
    "its trials start from, and its replay is the check that the two traced models agree). "
    "What is left (the after profile, 171 profiled s at load about 7): the traced steps "
    "themselves, trials 75 % and speed passes 17 %, where torch's fake-tensor dispatch is "
    "55 % of all (its cache key 25 %, outputs rebuilt from the cache 16 %); writing the deep "
    "journals out and replaying them 11 %; the search's fit-point replays 5 %. The three "
    "measured configurations (1 x 64 plain and checkpointed, 4 x 16 at 25 blocks) are about "
    "half of the row: a trial of 5 micro-steps and a speed pass of 3 each, 22 of the 44.8 "
    "s; a replay of middle micro-steps as of middle layers is the next lever.",
    "Round 8 (microstep row, 27 Nov 2026): the micro-step replay "
    "(docs/design.md#the-micro-step-replay, autotune/engine/replay/microstep_replay.py): on one "
    "rank a trial of 4 or 5 micro-"
    "steps (the tuner's measured 1 x 64 and 4 x 16 trace min(G, 5)) traces the shallow "
    "model's step of 3 micro-steps, a first, a middle and a last, and writes its journal out "
    "for 4 or 5 before the layer replay writes it out for the deep model: each unit of the "
    "step (a micro-batch's making, its item count, a micro-step) repeated, its middle copy "
    "standing for every other after a check that the last copy is the middle one. The journal"
    " written out is the step of 4, 5 or 7 traced whole, record for record, and every trial "
    "of 4, 5 or 64 micro-steps (LoRA and full, plain, checkpointed and partial, that fit and "
    "that run out) is the whole model's trace to the byte "
    "(tests/autotune_tests/engine/replay/test_microstep_replay.py); DDP's and FSDP2's ranks trace "
    "min(G, 5) as before. llama8b-lora-tune: 53.8 CPU s at load 11.2, against 61.6 CPU s at "
    "load 10.8 for main's code (47cf06b, the tune-speed row's engine) run right after it on "
    "the same box (2 cores shared with other helpers' tests and benches); 34 traced micro-"
    "steps against 40, the same 18 traced steps, the same answers to the byte (maxima, 1 x 64"
    " without checkpointing, samples/s 0.7019982546327984, peak 55,444,504,576 B). The "
    "measured configurations' trials (calls_cpu_s): 1 x 64 plain 3.05 s, checkpointed 4.51, 4"
    " x 16 at 25 blocks 6.06, against 5.35, 7.07 and 8.09 (13 % less in all; each figure is "
    "one run at a load of 11 on 2 cores, where CPU seconds stretch too). "
    "qwen0.5b-accumulation: 3.8 CPU s at load 11.6 (3.8 at load 5.1 in the bytecode row), 9 "
    "traced micro-steps against 11 (G = 8's trial traces 3), the bytecode row's step times "
    "and peaks to the byte; G = 64 and 2^20 are still answered from G = 8's traces. The 30 s "
    "goal is not shown met at this load. Checked and not taken: one traced step of 3 micro-"
    "steps for both the trial and the speed pass of a measured configuration (both now trace "
    "the same 3 micro-steps): the speed pass's kernel times keep the storages they tag (and "
    "the gradients) alive for the pass (autotune/engine/replay/layer_speed.py, `_kept`), so under "
    "one trace the journal's frees would come late, not the trial's to the byte; it would "
    "need the kernel times to keep their tags otherwise. What is left (a cProfile of the same"
    " tune at load about 11, 1,052 profiled s, compare shares): the 18 traced steps 85 % "
    "(trials 59 %, the three speed passes 27 %), torch's fake-tensor dispatch most of them as"
    " before; writing the deep journals out and replaying them through the allocator model 7 "
    "% (expand 3 %, evaluate 4 %); the search's fit-point replays 2.4 %; writing 3 micro-"
    "steps out for 4 or 5 0.6 %. A trial and a speed pass of each measured configuration, "
    "both 3 micro-steps now, are still two traces: sharing one is the next lever.",
    "Profiles of llama8b-lora-tune (cProfile of the timed part, paths shortened), before (the "
    "sharded-replay code, 284.8 profiled s at load about 2.5) and after (this row's code, "
    "171.3 s at load about 7; the two loads differ, compare shares):\n\n```\n"
    "before, by tottime:\n"
    "837246/218939  17.520  65.722  fake_tensor.py:1904(_prep_args_for_hash)\n"
    "       177972   9.719  47.423  fake_tensor.py:2197(_get_output_tensor_from_cache_entry)\n"
    "     35678461   9.509   9.702  {built-in method builtins.isinstance}\n"
    "           48   9.285 148.695  {method 'run_backward' of 'torch._C._EngineBase' objects}\n"
    "       256083   9.222  31.404  fake_tensor.py:1263(_flatten_into)\n"
    "1509564/384810  8.823 228.833  torch/_dynamo/eval_frame.py:1423(_fn)\n"
    "before, by cumulative (ours):\n"
    "    17   229.829  autotune/engine/estimate.py(trial)\n"
    "431510   170.436  autotune/engine/emulation/layer_journal.py(__torch_dispatch__)\n"
    "431510   162.805  autotune/engine/emulation/tracker.py(__torch_dispatch__)\n"
    "     3    45.556  autotune/engine/estimate.py(_timed_step)\n"
    "    19    14.856  autotune/engine/replay/layer_replay.py(evaluate)\n"
    "    26    10.137  autotune/core/memory/allocation_trace.py(replay)\n"
    "    19     8.627  autotune/engine/replay/layer_replay.py(expand)\n"
    "after, by tottime:\n"
    "661358/173543  10.633  39.382  fake_tensor.py:1904(_prep_args_for_hash)\n"
    "     28318811   6.051   6.181  {built-in method builtins.isinstance}\n"
    "       140920   5.668  26.906  fake_tensor.py:2197(_get_output_tensor_from_cache_entry)\n"
    "       201707   5.475  19.088  fake_tensor.py:1263(_flatten_into)\n"
    "           40   4.918  84.083  {method 'run_backward' of 'torch._C._EngineBase' objects}\n"
    "           19   4.848   7.772  autotune/engine/replay/layer_replay.py:147(expand)\n"
    "after, by cumulative (ours):\n"
    "    17   127.907  autotune/engine/estimate.py(trial)\n"
    "318530    95.181  autotune/engine/emulation/layer_journal.py(__torch_dispatch__)\n"
    "     3    28.403  autotune/engine/estimate.py(_timed_step)\n"
    "    19    11.872  autotune/engine/replay/layer_replay.py(evaluate)\n"
    "    26     8.910  autotune/core/memory/allocation_trace.py(replay)\n"
    "    19     7.772  autotune/engine/replay/layer_replay.py(expand)\n"
    "434610/302238  111.955  torch/_dynamo/eval_frame.py:1423(_fn)\n"
    "```",
    "Round 8 (probe70b row, 27 Nov 2026): llama70b-lora-zero3-probe, 20.7 CPU s at load 11.0, "
    "the same answers to the byte; run back to back with main (47cf06b) at load 11.4-11.9: "
    "14.8 and 20.6 CPU s against 22.1 and 21.1. qwen7b-lora-probe: 12.7 CPU s at load 12.1 "
    "(11.9 against main's 13.7 back to back at load 11), the same answers. First, main was not "
    "slower than the oom-replay row's commit: b5083b1 and 47cf06b run back to back, twice each "
    "at load 3.8-3.9, took 22.7 and 26.9 against 25.7 and 21.0 CPU s (the same answers), so the "
    "spread from one run to the next on the shared cores (about 20 %) hides any difference, and "
    "the oom-replay row's 17.8 was not reproduced by its own commit. Three cuts, each leaving "
    "the journals and answers as they were. (1) A fitted allocation model keeps each replay (a "
    "pure function of the micro-batch, the capacity and the settings): the probe's searches "
    "asked for 18 replays of 4 sizes of an 80-layer trace (the prediction, the check that the "
    "replay agrees with every trial, made twice, the dips below the answer), 4.05 CPU s at load "
    "4.9; now 4 replays, 0.7-1.0 s. (2) expand writes a repeated layer's run out from a program "
    "worked out once per traced layer (allocations and ops copied as blocks, only the records "
    "naming another event renumbered): the probe's 8 write-outs of the same journals 0.53 CPU s "
    "against 1.57-1.68, the deep journals equal, and evaluate's loop on local names (about 10 "
    "%). (3) The estimate's fake-tensor mode leaves torch's guard against torch.compile, as the "
    "trackers did in round 7 (some 12,000 guarded fake dispatches a traced step; none now). "
    "What is left (the same probe timed by function at load 4.3 with cut 1 only: 19.1 CPU s): "
    "the 8 traced steps of the 5-layer model 14.0 s, writing the deep journals out 1.5 s (now "
    "about a third of it) and replaying them 1.1 s, the model's replays 1.0 s and live peaks "
    "0.4 s, the build 1.2 s. The traced steps are torch's fake-tensor dispatch: its cache "
    "answered 37,279 ops and missed 2,002, and 4,346 bypassed it, each a full dispatch "
    "(_unsafe_view 1,433, a constant-carrying fake tensor 1,268, FSDP2's own copy ops 953, a "
    "real tensor among the inputs 612). The 15 s goal is met in one run of four at load 11 and "
    "not shown met: the load of the other sessions moves a run by more than what is left above "
    "it. Not tried: skipping repeated middle layers in the allocator model's replay once its "
    "state repeats (the forward's saved activations grow the live set layer by layer, so its "
    "state repeats only up to a shift of addresses, which would need its own proof).",
    "Quiet rows (27 Nov 2026, main ada725c, the first minutes of a session with nothing else on "
    "the 2 cores, load 0.9-1.0): the same code's figures without the other sessions' load. "
    "llama70b-lora-zero3-probe: 16.8 CPU s (goal 15; 14.8-20.7 at load 11 in round 8): the 2 "
    "warm-ups 3.8 s, the 6 trials 10.9 s (1.2 to 2.6 each), the build 0.6 s, the rest (the "
    "search's replays of the 80-layer traces) about 1.5 s. llama8b-lora-tune: 41.0 CPU s (goal "
    "30; 53.8 at load 11.2 in round 8): the warm-up 1.1 s, 11 trials 18.3 s (the two measured "
    "configurations' trials of 4-5 micro-steps 3.9 and 3.7), 2 speed passes 4.6 s, 6 partial "
    "checkpointing trials 9.5 s (the first, 4.5 s, builds the 8-layer model), its speed pass "
    "3.1 s, the tuner's own about 4 s. Both peaks at the answer moved from the earlier rows' by "
    "the residents' placement where the warm-up left them (issue 24, landed after round 8): "
    "the 70B probe's checkpointed 4 needs 79,721,136,128 B (81,124,130,816 before), the 8B "
    "tune's 1 x 64 57,520,685,056 B (55,444,504,576); the maxima and the recommendation are "
    "the same.",
    "Round 9 (trace-share row, 27 Nov 2026): a measurement traces its trial's shallow step and "
    "its speed pass once (docs/design.md#the-layer-replay, item 4; LayerReplay.timed_along): a "
    "trial of G >= 3 micro-steps traces the shallow step of 3 the speed pass traces, so the "
    "speed pass's modes run around the trial's. The kernel times now hold no tensor of the "
    "step (a tag goes as its storage dies, a foreach kernel is kept as its arithmetic), which "
    "is what kept the round 8 attempt from the trial's bytes; a step whose attention the "
    "speed pass would change (dropout, the fused kernel's emulation without grouped-query "
    "attention) is timed by its own pass. Tests compare a measurement with the trial and the "
    "speed pass traced apart (peaks and allocation traces to the byte, times to 1e-12 "
    "relative), plain, checkpointed and partial, LoRA and full "
    "(tests/autotune_tests/engine/replay/test_layer_speed.py). llama8b-lora-tune: 15 traced steps "
    "and 25 micro-steps against 18 and 34, every speed pass answered from its trial's trace "
    "(step_time_s 0.0 s each); the same answers to the byte (maxima, 1 x 64 without "
    "checkpointing, samples/s 0.7019982546327984, peak 57,520,685,056 B). CPU s, run back to "
    "back with main (df0062d) on the same 2 cores shared with other sessions: this code 50.5 "
    "at load 9.1 and 62.2 at load 10.9 (the row), main 65.4 at load 11.2; the load moves a "
    "run by more than the lever (main's three speed passes were 12.3 CPU s of its 65.4 here, "
    "4.6 + 3.1 of the quiet row's 41.0), so the 30 s goal is not shown met: a quiet rerun "
    "would say. Left as it was: the tuner's own seconds are mostly optuna's RDB storage (a "
    "new SQLite study: 2.1 CPU s at load 11, 0.15 once its modules are imported) and the "
    "search's fit-point replays of the deep traces; the partial model's build and warm-up "
    "(its first trial) checks its warm-up against the 5-layer one's and was not cut. "
    "qwen0.5b-accumulation: 5.8 CPU s at load 10.5 against main's 7.3 at load 10.6 run beside "
    "it, 3 traced steps and 5 micro-steps against 5 and 9 (G = 1's and G = 8's trials trace "
    "their speed passes: 1.0 and 3.2 s against 0.9 + 0.7 and 2.5 + 1.5); step times and peaks "
    "main's to the byte (the peaks 115,343,360 B under the microstep row's: the residents' "
    "placement of issue 24, main's too).",
    "fake-cache (27 Nov 2026, issue 27 section 0): two cuts, the answers of both cases equal "
    "to main's (df0062d) to the byte. Run back to back with main at load 10-11 (the other "
    "sessions' benchmarks and tests on the 2 cores): llama70b-lora-zero3-probe 24.8 CPU s "
    "against 25.1 (trials 14.2 against 15.9, warm-ups 7.4 against 6.0: the load's noise is "
    "larger than the cut), qwen7b-lora-probe 11.3 against 13.9; a second pair at load "
    "7.1-11.1: the 70B 21.2 against 26.7, the 7B 12.4 against 15.8 (ours at the lower load "
    "in both). The 15 s goal is not shown met: no "
    "quiet cores this session. "
    "Where the 70B probe's time goes (main, timed by function at load 3-4, 20-22 CPU s): the "
    "8 traced steps 15.5 s, of which torch's fake-tensor dispatch 10.9 s (39,000 cache hits "
    "about 5.6 s, 1,900 misses 1.4, 2,900 bypasses 0.9), the deep journals' write-out 1.3 s, "
    "their replay (evaluate) 2.0, the allocation model's replays 1.3, the build 0.8-1.2; "
    "cProfile's top by own time (88 profiled s): _prep_args_for_hash 4.6 (16.9 with callees), "
    "isinstance 3.3, the allocator's _alloc_found_block 3.2, _flatten_into 2.7, "
    "_get_free_block 2.1, malloc 2.0, free 2.0, evaluate 1.9, the cache entry's output 1.8, "
    "FakeTensor.__new__ 1.7; by cumulative time ResidentPlacement.place 11.8 of 88 (10 "
    "calls, 395,180 of the 676,086 mallocs). (1) ResidentPlacement.place replayed the "
    "warm-up's 40,000 events into every fresh allocator (the trials' tracker, each deep "
    "journal's replay, each allocation-model replay): the state they leave is a function of "
    "the warm-up and the allocator's settings, so it is now replayed once per settings and "
    "restored (CachingAllocator.clone) after: the 10 placements 1.67 -> 0.66 CPU s at load "
    "3-5. (2) torch's fake-tensor cache never answers aten._unsafe_view (not marked a view), "
    "1,433 uncached dispatches of the probe; below autograd it is view's kernel, which the "
    "cache answers, so the estimate's fake mode calls view for it (the bypasses 4,346 -> "
    "2,913, the hits as before: each bypass had made a cached view inside). What is left of "
    "the bypasses is not ours to cut: the constant-carrying tensors are Adam's step counts "
    "(its .item() needs the constant: 1,120 reads, 0.1 s), the non-fake inputs FSDP2's "
    "DTensors, which a mode sees before their own dispatch unwraps them (Adam's state init "
    "and foreach ops, 612), the non-builtin ops FSDP2's own copy-in/copy-out (953). The "
    "cache hits are the bulk and are torch's key and output work per op; the ops are the "
    "model's, FSDP2's (a view(uint8) and its detach per parameter at each all-gather's "
    "copy-in and copy-out, 7,360) and autograd's.",
    "Round 9 (tune70b, 27 Nov 2026): llama70b-lora-zero3-tune, the zero3 layout of "
    "bench/layouts.py's Llama-3-70B/lora/1x8 (809.6 CPU s in the lead's layouts run), as a "
    "whole tune here. Where the seconds went: at 80 layers the plain warm-up runs out (1 x 1 "
    "does not fit plain; checkpointed fits 4), and partial checkpointing's 8-layer traced "
    "model, built at the first partial trial and warmed up checkpointed only, failed its check "
    "against the replay's warm-up ('the two traced models' warm-ups differ'): the same "
    "allocations and peaks, but 7,372 more entries in the deep per-op series, FSDP2's lazy "
    "initialisation (some 23 view and detach ops a layer, no allocation) in the new model's "
    "first step, which the 5-layer model had run in its own first step, the plain warm-up that "
    "ran out. So every partial trial and speed pass was traced whole on 80 layers: timed by "
    "call (the same code, instrumented, at load 7-9), the probe and the G = 2 probe took 59.5 "
    "CPU s in all, then the fewest-blocks search of one candidate (2 x 32) 384 CPU s: 99.8 (the "
    "80-layer model's build and warm-up with its first trial), 9.2, 36.2, 65.0, 58.9, 60.3 and "
    "60.1, the run stopped there. A 20-layer stand-in (its plain warm-up fits) replays them all: "
    "98.1 CPU s at load 6.9, its profile torch's fake-tensor dispatch (17 traced steps, 34 "
    "micro-steps), the allocator model's replays and the write-outs not among the top entries. "
    "The cut tried (not committed): the 8-layer model runs every warm-up the replay ran, in "
    "order, each from where the residents were as the replay's started and each outcome "
    "checked against the replay's (`EstimateRunner._warm_partial`); at 80 layers its partial "
    "replay then holds. Not committed because its test failed one step earlier: on a 10-layer "
    "zero3 LoRA rank at 5 MiB (plain warm-up out, checkpointed fits), the replay's own "
    "checkpointed warm-up after the plain one that ran out is not the whole trace's (peaks "
    "equal, allocations equal, the per-op series not: 10,011 entries against the whole "
    "trace's 10,080, apart from entry 2,716): the 5-layer model completes the step the deep one "
    "runs out in, "
    "so what the replay starts its next step from is not proven, and a partial replay made to "
    "agree with it is not either. With the cut (commit 671902a, run apart): 106.2 CPU s at "
    "load 5.2 (357.9 s wall), the lead's answers (max 0 / 4, 1 x 64 with the first 58 of 80 "
    "blocks checkpointed, 78,070,677,504 B = 72.71 GiB), 19 traced steps (36 micro-steps), "
    "partial trials 0.4-16.1 CPU s each. No row: the tune without the cut runs some 800 CPU s.",
    "Merged row (27 Nov 2026, main e439bec..1d21b89: trace-share, fake-cache and zero1-speed "
    "merged): run beside the clean-clone CI at load 4.1, so its CPU seconds are not the quiet "
    "row's to compare with (the same code's spread at load 4 against load 1 is some 20-30 %). "
    "llama8b-lora-tune: 49.7 CPU s, 15 traced steps and 25 micro-steps (18 and 34 in the quiet "
    "row), both speed passes answered from their trials' traces, the same answers to the byte. "
    "llama70b-lora-zero3-probe: 22.9 CPU s, the same answers to the byte. A quiet rerun at a "
    "session's start is what says whether the goals (30 s and 15 s) are met.",
    "Quiet2 row (27 Nov 2026, main 1f9c662, the first thing on a fresh machine, load 1.0): "
    "llama70b-lora-zero3-probe 18.3 CPU s, llama8b-lora-tune 45.9, the answers the quiet row's "
    "to the byte. This machine is slower than the quiet row's: the quiet row's own commit "
    "ada725c, run on it straight after (not a row, same load), took 20.1 and 50.5 CPU s against "
    "the quiet row's 16.8 and 41.0. So the merges since ada725c cut both cases by 9 % on the "
    "same machine; neither goal (15 s and 30 s) is met. In the 8B tune the two speed passes "
    "cost 0.0 s (answered from their trials' traces; 4.8 s at ada725c) and the trials 1.1-5.3 s "
    "each (1.2-4.5 at ada725c): timing a trial's kernels as it is traced costs about what the "
    "separate passes saved.",
    "Warm-init row (27 Nov 2026, branch warm): llama70b-lora-zero3-tune, 117.6 CPU s at load "
    "5.9 (285.8 s wall), against some 800 before (Round 9's note: every partial trial traced "
    "whole on 80 layers). The cause was FSDP2's lazy initialisation: a unit makes its "
    "gathered-parameter buffers at its first all-gather, so after the plain warm-up that ran out "
    "the deep model's next step initialised the blocks it had not reached, the 5-layer model's "
    "(whose step completed) none, and the 8-layer model's first step all of its own. Now an "
    "estimated rank runs the initialisation before its first step, outside any tracker "
    "(`sharding.initialise`), every step runs the same ops whatever ran before, and the "
    "8-layer model's warm-up is the replay's: all 15 partial trials replayed (0.4-17.5 CPU s, "
    "three of them 13-17.5 s, the first with the 8-layer model's build and warm-up), 18 "
    "traced steps, 35 micro-steps. The answers are Round 9's with the cut: max 0 / 4, 1 x 64 "
    "with the first 58 of 80 blocks checkpointed, 0.1861599548205073 samples/s per GPU, "
    "78,070,677,504 B. The test (test_layer_replay_sharded.py, a 10-layer zero3 LoRA rank at "
    "5 MiB) failed before in the replay's checkpointed warm-up itself (10,011 ops against the "
    "whole trace's 10,080: 23 `empty` and 46 view ops of the one block the plain warm-up had not "
    "reached).",
    "Foreach row (27 Nov 2026, 6e87857): the speed model now times aten's in-place foreach "
    "kernels and fused optimizers (docs/design.md, Speed), which return nothing and were not "
    "timed: a kernel's outputs are what it returns plus the arguments its schema marks "
    "written. AdamW's foreach step moves 21 fp32 copies of its parameters instead of the 2 of "
    "`_foreach_sqrt` alone. llama8b-lora-tune: the same maxima, configuration (1 x 64 plain) "
    "and peak; samples/s 0.7019292042998818 against 0.7019982546327984 (-0.0098 %), the 1 x 64 "
    "step 91.1773 s against 91.1683 s: +8.97 ms, what 19 more fp32 copies of the 167,772,160 "
    "adapter parameters take at 70 % of an A100's 2.039 TB/s (8.93 ms) plus 8 launches of 5 "
    "us. A full fine-tune's step moves 19 copies of all its parameters more, and with little "
    "accumulation the optimizer is a larger share of the step. 53.4 CPU s at load 5.1 (45.9 "
    "at load 1.0 in the quiet2 row: the load, not the change; the same 15 traced steps).",
    "Search-ahead row (27 Nov 2026, e4b8169; docs/design.md#the-micro-step-replay): partial "
    "checkpointing's fewest-blocks search (the tuner's trials of 4 x 2 at 16, 24, 28, 26 and 25 "
    "of 32 blocks) is followed by the measurement of the count it finds (4 x 16 at 25), whose "
    "trial and speed pass trace the 8-layer model's shallow step of 3 micro-steps, the step the "
    "search's counts share (partial_plan: 4 of 8 layers checkpointed). Now the search's first "
    "trial of a shallow step traces that step of 3 with the speed pass along and writes it out "
    "for 2 (microstep_replay.write_out, first and last copies), and the measurement traces "
    "nothing: 14 traced steps (23 micro-steps) against 15 (25). Tests: a journal written out "
    "for 2 is the step of 2 traced whole (LoRA and full, plain and checkpointed), the search's "
    "partial trials of 2 are the 12-layer model's traced whole, and a measurement after the "
    "search equals one measured alone to the bit (test_layer_speed.py, "
    "test_the_fewest_blocks_search_traces_the_step_its_measurement_then_answers). The same "
    "answers to the byte (maxima, 1 x 64 plain, samples/s 0.7019982546327984, peak "
    "57,520,685,056 B; the 4 x 16 at 25 blocks' step 117.69934346592024 s both ways). "
    "llama8b-lora-tune, the row: 46.4 CPU s at load 5.2 (2 cores "
    "shared with three other sessions); main's code (6cde346) run right after it: 58.6 CPU s at "
    "load 5.1 (47.9 at load 3.3 earlier the same session). Partial checkpointing's calls "
    "(calls_cpu_s): 12.4 s against 18.7 back to back (first trial 9.7 against 7.1: it traces 3 "
    "micro-steps with the kernel times instead of 2; the measurement's trial 0.7 against 9.9); "
    "a logged run of each at load 3.4-5.5: 11.8 against 16.0. The rest of the gap back to back "
    "(the plain trials 28.1 against 33.5, the same code) is the load's. So the cut is some 4-6 "
    "CPU s; the 30 s goal is not met (a quiet rerun would place it near 40). Checked and not "
    "taken: the tuner's G = 2 probe tracing 3 ahead too (its plain 1 x 2 precedes the measured "
    "1 x 64, but the checkpointed 4 x 2 and 2 x 2 are never measured: about 1.5 s more each, "
    "for 3.9 saved); a trial of 2 written out from a step of 3 traced before of the same "
    "configuration (its own answers equal the whole trace's, but the uniform test's later trial "
    "4 x 64 at 12 MiB then differed from the whole runner's in its out-of-memory detail, the "
    "whole runner's history having run the extra steps of 2; not followed up). The tuner's own "
    "seconds (optuna's RDB storage about 1 s, of which its lazy imports most; the fit-point "
    "replays about 1.3 s) and evaluate (about 3 s) were left. Profiles of the timed part "
    "(cProfile, the bench's --profile, at load 4-5: 196.5 profiled s before, 189.7 after; "
    "compare shares): by tottime the same torch entries lead both (_prep_args_for_hash 11.0 "
    "before / 10.5 after, _get_output_tensor_from_cache_entry 5.4 / 6.0, isinstance 6.3 / 5.7, "
    "_flatten_into 5.6 / 5.3, run_backward 5.3 (25 calls) / 5.3 (23)); by cumulative, "
    "estimate.trial 179.4 (17 calls) / 165.3, the shallow traces (layer_replay._journal) 151.2 "
    "(15) / 141.9 (14), layer_replay.evaluate 17.0 after (19 calls).",
    "quiet3 and trace-key rows (28 Nov 2026, a fresh machine, nothing else running, load "
    "0.8-1.0, the two runs back to back): quiet3 is main before (8676c74), trace-key the two "
    "cuts of 3ca49dd. This machine is slower than the quiet2 row's: the same 70B probe took "
    "26.8 and 25.7 CPU s at 8676c74 here, and 1f9c662 (the quiet2 row's 18.3) 21.5 and 27.9 "
    "run beside it: a run's CPU seconds move by some 25 % from one run to the next on these "
    "shared cores. (1) A fake tensor's device query is answered by the tracker that meets it, "
    "as the fake mode below would answer it: of a 7B LoRA trial's 7,711 dispatches 5,323 are "
    "device queries (3,391 from the autograd engine), 41 us each through the two Python modes, "
    "9 us now. (2) The estimate's fake mode (autotune/engine/trace_mode.py) keeps a map in front "
    "of torch's cache, keyed by what torch's key is made of read straight off the arguments, "
    "holding torch's entry and key: a cached view 133 us instead of 216, a matrix product 209 "
    "instead of 282 (2,000 calls each). A 70B trial now makes about 4,640 such hits, 300 torch "
    "misses (a new micro-batch's shapes) and 280 bypasses (Adam's step counters carry a "
    "constant, FSDP2's copy ops are not builtin). CPU s, quiet3 -> trace-key: "
    "qwen7b-lora-probe 14.8 -> 10.2 (goal 8), llama70b-lora-zero3-probe 25.7 -> 23.4 (goal "
    "15; A/B pairs run alternately at load 1-2: 26.3/23.6, 26.6/25.7, 23.5/19.8), "
    "llama8b-lora-tune 47.6 -> 39.8 (goal 30); the answers are quiet3's to the byte. What is "
    "left, by own time in a sampled profile of the 70B probe (py-spy, 200 Hz): torch's "
    "fake-tensor code 26 % (meta_utils, _prims_common and the dispatcher another 12 %), the "
    "allocator model 14 % (the 80-layer journals' replays and the search's), the trackers, "
    "autocast and attention emulation 10 %, the layer replay's write-out and evaluate 9 %, "
    "the map's key 6 %; by phase the two warm-ups 30 % (the plain one runs out at 1).",
    "quiet4 and no-full-gc rows (28 Nov 2026, a fresh machine, nothing else running, load "
    "1.0, the two runs back to back; quiet4 with PYTHONPATH on a worktree of b0c81c9, whose "
    "estimate is trace-key's): no full garbage collection while a probe or a tune runs "
    "(autotune/engine/full_collections.py). Counted with gc.callbacks, CPython's full "
    "collections (each scans the whole heap: some 560,000 long-lived objects of the imported "
    "modules and what the trials keep) took 4.5 CPU s in 12 collections of the 8B tune, 3.0 s "
    "in 10 of the 70B probe and 1.9 s in 9 of the 7B probe; now the sessions run none (the 7 "
    "left in each case's process come while torch and transformers are imported, outside the "
    "figures), and the young collections cost about 1 s as before. CPU s, quiet4 -> "
    "no-full-gc: qwen7b-lora-probe 10.8 -> 10.1 (goal 8), llama70b-lora-zero3-probe 19.5 -> "
    "16.4 (goal 15), llama8b-lora-tune 38.2 -> 33.3 (goal 30); alternate A/B runs of the 7B "
    "probe before the rows, at load 1.2-2.3: 12.0/8.6, 12.5/10.4, 10.7/11.4, and of the 70B "
    "probe 25.0/17.0, 18.9/17.0. Peak RSS grew by up to 13 MiB (the 8B tune's 588 MiB): cyclic "
    "garbage promoted during a session waits for the first full collection after it. The "
    "answers are quiet4's and trace-key's to the byte.",
    "fast-build row (28 Nov 2026, an hour after the no-full-gc row, load 1.0-1.2, 39e2136): a "
    "hit of the trace mode's map builds its one new tensor as torch's path does, without "
    "torch's generic per-call checks (autotune/engine/trace_mode.py, TraceMode._build). "
    "Timed inside the 7B probe: 21,149 hits built at 38 us each (0.81 s) and 2,201 that keep "
    "torch's path (several outputs, an in-place op's argument) at 122 us, against 23,350 at 72 "
    "us (1.68 s) before. CPU s: qwen7b-lora-probe 9.7, llama70b-lora-zero3-probe 17.9, "
    "llama8b-lora-tune 33.5; the machine ran slower than in the no-full-gc row's hour, so "
    "the A/B pairs run alternately just before this row say more (no-full-gc's 66159e5 / "
    "39e2136): the 7B probe 11.1/10.6 and 11.8/8.2, the 70B probe 18.1/17.2 and 22.5/17.2. "
    "The answers are quiet4's to the byte.",
    "machine40 and session40 rows (28 Nov 2026, a new machine, load 0.8-1.0): machine40 is "
    "session 39's last commit (3595834) rerun here for the machine's measure, session40 this "
    "session's (181cd14: the constant's .item() answered by the trace mode, the probe of "
    "accumulation without a fit point for dips nobody reads and with its bet below a failing "
    "hint; a rank of several's timing from its trial's trace does not touch these one-rank "
    "cases). This machine ran the same code 30-40 % faster than session 39's at the session's "
    "start (3595834: 5.0, 9.2 and 17.5 CPU s at 12:42 UTC) and slower later: alternate runs an "
    "hour later, machine40 / session40, the 7B probe 7.2/7.3 and 4.4/4.7, the 70B probe "
    "14.3/12.3 and 13.9/8.2, the 8B tune 22.1/15.7 and 19.2/14.9 (the rows are the second "
    "pair). On this machine every sample meets section 0's goals (8, 15 and 30 CPU s); on "
    "session 39's machine the same code took 9.7, 16.4-17.9 and 33.5. The answers are the "
    "same but for the 8B tune's samples/s, 3.8e-12 relative lower: a middle micro-step's share "
    "now counts its count's add to the counts before it, as the step's sum does "
    "(docs/design.md#the-micro-step-replay).",
]


def speed_spec(name: str) -> Spec:
    _, config, training, _, _ = SPEED_CASES[name]
    return Spec.model_validate(
        {
            "model": {"hf_config": config},
            "training": {"precision": "bf16", "seq_len": 4096, "max_micro_batch": 64, **training},
        }
    )


def _import_what_the_case_builds(spec: Spec) -> None:
    """Imports are not in the timed figures: transformers imports a model's module on first use
    of its class, and peft its tuners, which would otherwise fall inside the build (about 2 CPU
    s of the 7B LoRA probe's)."""
    import transformers

    config = spec.model.hf_config
    assert config is not None
    hf_config = transformers.AutoConfig.for_model(**config)
    transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    if spec.training.lora is not None:
        importlib.import_module("peft.tuners.lora")


def speed_case(name: str, profile: bool) -> dict[str, Any]:
    """Runs one case in this process (a child of `--speed`): its answers and what it cost."""
    import cProfile
    import io
    import pstats
    import resource
    import tempfile

    from autotune.engine.tuner import tune_session

    spec = speed_spec(name)
    _, _, _, gpu, kind = SPEED_CASES[name]
    from autotune.engine.training.step import TrainingStep

    # Every traced step goes through TrainingStep.run: count them and their micro-steps.
    traced: list[int] = []
    run = TrainingStep.run

    def counted(step: TrainingStep, micro_batch: int, accumulation_steps: int = 1) -> float:
        traced.append(accumulation_steps)
        return run(step, micro_batch, accumulation_steps)

    TrainingStep.run = counted  # type: ignore[method-assign, assignment]
    _import_what_the_case_builds(spec)
    profiler = cProfile.Profile() if profile else None
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    runner = EstimateRunner(spec, gpu=budget_for(find_gpu(gpu), spec.training.world_size))
    answers: dict[str, Any] = {}
    phases: dict[str, float] = {"build_s": time.perf_counter() - started}
    calls = _timed_calls(runner)
    if kind == "probe":
        result = probe_session(runner)
        answers["max"] = {str(m.checkpointing).lower(): m.max_micro_batch for m in result.modes}
        answers["peak_at_max"] = {
            str(m.checkpointing).lower(): next(
                (
                    a.peak_bytes
                    for a in m.attempts
                    if a.micro_batch == m.max_micro_batch and a.fits
                ),
                None,
            )
            for m in result.modes
        }
        answers["trials"] = sum(len(m.attempts) for m in result.modes)
    elif kind == "tune":
        with tempfile.TemporaryDirectory() as directory:
            tuned = tune_session(
                runner,
                storage_url=f"sqlite:///{directory}/optuna.db",
                n_trials=TUNE_TRIALS.get(name),
            )
        recommendation = tuned.recommendation
        answers["max"] = {
            str(m.checkpointing).lower(): m.max_micro_batch for m in tuned.probe.modes
        }
        answers["recommendation"] = (
            None
            if recommendation is None
            else {
                "micro_batch": recommendation.micro_batch,
                "accumulation_steps": recommendation.accumulation_steps,
                "checkpointing": recommendation.checkpointing,
                "checkpointed_blocks": recommendation.checkpointed_blocks,
                "samples_per_s": recommendation.samples_per_s,
                "peak_bytes": recommendation.peak_bytes,
            }
        )
        answers["measured"] = len(tuned.trials)
    else:
        assert runner.warm_up().fits
        for steps in ACCUMULATIONS:
            measure_started = time.perf_counter()
            measured = runner.measure(1, steps, checkpointing=False, target_seconds=1.0)
            assert measured is not None
            phases[f"G={steps}_s"] = time.perf_counter() - measure_started
            answers[f"G={steps}"] = {
                "step_time_s": measured.step_time_s,
                "peak_bytes": measured.peak_bytes,
            }
    if profiler is not None:
        profiler.disable()
    answers["replayed"] = {
        "trials": runner.layer_replay,
        "speed": runner.speed_replay,
        "partial_trials": runner.partial_replay,
        "partial_speed": runner.partial_speed_replay,
    }
    row: dict[str, Any] = {
        "case": name,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_average": os.getloadavg()[0],
        "traced_steps": len(traced),
        "traced_micro_steps": sum(traced),
        "calls_cpu_s": calls,
        **phases,
        "answers": answers,
    }
    if profiler is not None:
        tops = {}
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(15)
            tops[order] = _profile_lines(text.getvalue())
        row["profile"] = tops
    return row


def _timed_calls(runner: EstimateRunner) -> dict[str, list[float]]:
    """The CPU seconds of each warm-up, trial and speed pass `runner` answers, by kind (partial
    checkpointing's apart; answers from an earlier trace included, at about 0 s)."""
    calls: dict[str, list[float]] = {}
    for method in ("warm_up", "trial", "step_time_s"):
        original = getattr(runner, method)

        def timed(*args: Any, _original: Any = original, _method: str = method, **kw: Any) -> Any:
            started = time.process_time()
            try:
                return _original(*args, **kw)
            finally:
                partial = kw.get("checkpointing") and kw.get("checkpointed_blocks") is not None
                kind = f"{_method} partial" if partial else _method
                calls.setdefault(kind, []).append(round(time.process_time() - started, 2))

        setattr(runner, method, timed)
    return calls


def _profile_lines(text: str) -> list[str]:
    """The table of a pstats listing, paths shortened to what follows site-packages or the
    repository."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    root = str(Path(__file__).resolve().parents[1]) + "/"
    kept = []
    for line in lines[start : start + 16]:
        line = line.replace(root, "")
        kept.append(re.sub(r"\S*site-packages/", "", line).rstrip())
    return kept


def _compile_lazily_imported() -> None:
    """Bytecode for the packages a case imports while it runs (the transformers model, peft), as
    an installed package has it: this sandbox sets PYTHONDONTWRITEBYTECODE=1, so a module no
    earlier run had compiled was compiled from source inside every case's timed CPU seconds
    (2-4 s of the 7B probe's). compileall writes the bytecode whatever that variable says, and
    skips what is compiled already."""
    import compileall
    import importlib.util

    for name in ("transformers", "peft"):
        found = importlib.util.find_spec(name)
        if found is not None and found.origin is not None:
            compileall.compile_dir(Path(found.origin).parent, quiet=1, workers=0)


def speed(cases: list[str], label: str, profile: bool) -> int:
    """Each case in a child process; the figures filed under `label` in estimator_speed.*."""
    import subprocess

    document: dict[str, Any] = (
        json.loads(SPEED_JSON.read_text()) if SPEED_JSON.exists() else {"runs": {}}
    )
    runs = document["runs"].setdefault(label, {})
    _compile_lazily_imported()

    def child(name: str, *flags: str) -> dict[str, Any] | None:
        command = [sys.executable, __file__, "--speed-case", name, *flags]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return None
        row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return row

    for name in cases:
        row = child(name)
        if row is None:
            return 1
        if profile and name == "qwen7b-lora-probe":
            # A run of its own: the profiler's cost stays out of the timed figures.
            profiled = child(name, "--profile")
            if profiled is None:
                return 1
            row["profile"] = profiled["profile"]
        row["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        runs[name] = row
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        document["machine"] = (
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        )
        _write_speed(document)
    return 0


def _write_speed(document: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    SPEED_JSON.write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        "# What an estimate costs",
        "",
        f"Made by `bench/estimator.py --speed [--profile] --label {'|'.join(SPEED_LABELS)}` on "
        f"{document['machine']}, each case in a child process of its own. The machine's 2 cores "
        "were shared with other jobs (the load average is beside each figure), so wall seconds "
        "stretch with the load; CPU seconds (user + system of the child) are the figure to "
        "compare. Imports are not in either; RSS is the child's peak, imports included.",
        "",
        "| case | run | commit | wall (s) | CPU (s) | build (s) | peak RSS (MiB) | load "
        "| traced steps (micro-steps) | answers |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in SPEED_CASES:
        for label in SPEED_LABELS:
            row = document["runs"].get(label, {}).get(name)
            if row is None:
                continue
            answers = {k: v for k, v in row["answers"].items() if not k.startswith("G=")}
            accumulations = [
                f"G={g}: {row[f'G={g}_s']:.1f} s" for g in ACCUMULATIONS if f"G={g}_s" in row
            ]
            lines.append(
                f"| {name} | {label} | {row['commit']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} "
                f"| {row['build_s']:.1f} | {row['peak_rss_mib']:,.0f} | {row['load_average']:.1f} "
                f"| {row.get('traced_steps', '?')} ({row.get('traced_micro_steps', '?')}) "
                f"| {json.dumps(answers) if answers else ''}{'; '.join(accumulations)} |"
            )
    lines += ["", "Cases:", ""]
    lines += [f"- {name}: {what}" for name, (what, *_rest) in SPEED_CASES.items()]
    lines += ["", *[line for note in SPEED_NOTES for line in (note, "")]]
    for label in ("before", "after"):
        row = document["runs"].get(label, {}).get("qwen7b-lora-probe")
        if row is None or "profile" not in row:
            continue
        lines += [
            "",
            f"## Profile of qwen7b-lora-probe, {label} (cProfile, which slows it about 2x)",
            "",
        ]
        for order, top in row["profile"].items():
            lines += [f"By {order}:", "", "```", *top, "```", ""]
    (RESULTS / "estimator_speed.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny presets and one model")
    parser.add_argument(
        "--large-only", action="store_true", help="keep the committed zoo rows, redo part 2"
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        choices=sorted(PRESETS),
        help="redo the zoo rows of these presets only, keeping the other committed rows and parts",
    )
    parser.add_argument(
        "--speed", nargs="*", choices=sorted(SPEED_CASES), help="the speed part (all cases)"
    )
    parser.add_argument(
        "--expandable-column",
        action="store_true",
        help="add the estimate under expandable segments to the committed zoo rows only",
    )
    parser.add_argument("--label", choices=SPEED_LABELS, default="speed-replay")
    parser.add_argument("--profile", action="store_true", help="profile the 7B probe")
    parser.add_argument("--speed-case", choices=sorted(SPEED_CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.speed_case:
        print(json.dumps(speed_case(args.speed_case, args.profile)), flush=True)
        return 0
    if args.speed is not None:
        return speed(args.speed or list(SPEED_CASES), args.label, args.profile)
    if args.expandable_column:
        return expandable_column()
    presets = ["cnn", "gpt2-tiny", "llama-tiny", "mlp"] if args.quick else sorted(PRESETS)
    rows: list[dict[str, Any]] = []
    if args.large_only:
        rows = json.loads((RESULTS / "estimator.json").read_text())["zoo"]
        presets = []
    if args.presets:
        committed = json.loads((RESULTS / "estimator.json").read_text())
        kept = [row for row in committed["zoo"] if row["preset"] not in args.presets]
        for name in args.presets:
            for capacity_bytes in capacities(preset_spec(name)):
                kept.append(zoo_row(name, capacity_bytes))
                print(json.dumps(kept[-1]), flush=True)
        kept.sort(key=lambda row: (row["preset"], row["capacity_bytes"]))
        _write(kept, committed["large"], committed["published"])
        return 0 if all(row["exact"] for row in kept) else 1
    for name in presets:
        for capacity_bytes in capacities(preset_spec(name)):
            rows.append(zoo_row(name, capacity_bytes))
            print(json.dumps(rows[-1]), flush=True)
            _write(rows, [])
    large: list[dict[str, Any]] = []
    models = ["Llama-3-8B"] if args.quick else list(LARGE_MODELS)
    for name in models:
        for gpu in ("H100 80GB", "H200 141GB"):
            large.append(large_row(name, gpu))
            print(json.dumps(large[-1]), flush=True)
            _write(rows, large)
    published = [published_row(checkpointing) for checkpointing in (False, True)]
    print(json.dumps(published), flush=True)
    _write(rows, large, published)
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
