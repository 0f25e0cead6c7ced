"""The longest-sequence probe: for one spec on one device, the longest sequence whose full
training step fits at a given micro-batch, without and with gradient checkpointing.

It wires the pure search (`autotune.core.search.sequence`) to trials. A sequence length is part
of the model's workload (its batches' shape), so every length gets a runner of its own, built by
the caller's `make_runner` for the spec at that length: the same device options, a traced
estimate or the emulated GPU alike. Each runner warms up (the optimizer state exists from the
first step on) and then runs the trial, as a probe does. Out-of-memory arrives as
`fits=False`; nothing here catches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from autotune.core.errors import SpecError
from autotune.core.presets import PRESETS, DecoderPreset
from autotune.core.schemas import (
    DeviceInfo,
    SequenceModeProbe,
    SequenceProbeResult,
    SequenceTrial,
    Spec,
    StepOutcome,
)
from autotune.core.search.sequence import DEFAULT_STEP_TOKENS, find_max_seq_len
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.runner import TrialRunner

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[Spec], TrialRunner]


class CheckpointingUnsupported(SpecError):
    """Checkpointing was asked of a model that cannot toggle it."""


# Called with (checkpointing, seq_len, outcome) as soon as a trial finishes.
SequenceCallback = Callable[[bool, int, StepOutcome], None]


def model_positions(spec: Spec) -> int | None:
    """The longest sequence the spec's model takes, where the spec says it: a preset's
    max_seq_len, a transformers config's max_position_embeddings (of its text config, for a
    multimodal one); None for a hub id or a factory (pass the cap)."""
    source = spec.model
    if source.preset is not None:
        preset = PRESETS[source.preset]
        return preset.max_seq_len if isinstance(preset, DecoderPreset) else None
    if source.hf_config is not None:
        config: dict[str, Any] = source.hf_config
        text_config = config.get("text_config")
        positions = (text_config if isinstance(text_config, dict) else config).get(
            "max_position_embeddings"
        )
        return positions if isinstance(positions, int) and positions > 0 else None
    return None


def sequence_cap(spec: Spec, *, step_tokens: int, cap_tokens: int | None) -> int:
    """The longest sequence the search may try: `cap_tokens`, else the model's positions.

    Raises:
        SpecError: not a token model, no cap known, or a cap below one step.
    """
    if spec.model.is_token_model is False or spec.training.input_shape is not None:
        raise SpecError("--max-seq-len: the model takes fixed-shape inputs, not sequences")
    cap = cap_tokens if cap_tokens is not None else model_positions(spec)
    if cap is None:
        raise SpecError(
            "--max-seq-len: the spec does not say the model's longest sequence (a hub id or a "
            "factory); give --seq-cap TOKENS"
        )
    if cap < step_tokens:
        raise SpecError(f"--seq-cap: {cap} tokens is below one step of {step_tokens} tokens")
    return cap


def sequence_trial(
    spec: Spec, make_runner: RunnerFactory, *, micro_batch: int, checkpointing: bool
) -> tuple[StepOutcome, TrialRunner]:
    """One steady-state step of `spec` at `micro_batch` on a runner of its own: the warm-up's
    outcome when even that runs out, else the trial's.

    Raises:
        CheckpointingUnsupported: checkpointing asked of a model that cannot toggle it.
    """
    runner = make_runner(spec)
    if checkpointing and not runner.supports_checkpointing:
        raise CheckpointingUnsupported(
            "checkpointing: this model cannot toggle gradient checkpointing"
        )
    outcome = runner.warm_up(checkpointing=checkpointing)
    if outcome.fits:
        outcome = runner.trial(micro_batch, checkpointing=checkpointing)
    return outcome, runner


@with_few_full_collections
def probe_max_seq_len(
    spec: Spec,
    make_runner: RunnerFactory,
    *,
    micro_batch: int = 1,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    cap_tokens: int | None = None,
    modes: tuple[bool, ...] = (False, True),
    on_attempt: SequenceCallback | None = None,
) -> SequenceProbeResult:
    """The exact longest multiple of `step_tokens` that fits at `micro_batch`, per mode.

    Args:
        spec: a token model's spec; its own seq_len is replaced by each length tried.
        make_runner: a runner for a spec (one per length: the length shapes the workload).
        cap_tokens: the longest length tried; None: the model's positions (`model_positions`).
        modes: the checkpointing modes to search; the checkpointed one is skipped for a model
            that cannot toggle it.

    Raises:
        SpecError: not a token model, no cap known, or a cap below one step.
    """
    cap = sequence_cap(spec, step_tokens=step_tokens, cap_tokens=cap_tokens)
    device: list[DeviceInfo] = []
    supports_checkpointing: list[bool] = []

    def search_mode(checkpointing: bool, known_fitting_tokens: int) -> SequenceModeProbe:
        def fits(seq_len: int) -> StepOutcome:
            outcome, runner = sequence_trial(
                spec.with_training({"seq_len": seq_len}),
                make_runner,
                micro_batch=micro_batch,
                checkpointing=checkpointing,
            )
            if not device:
                device.append(runner.device_info)
                supports_checkpointing.append(runner.supports_checkpointing)
            if on_attempt is not None:
                on_attempt(checkpointing, seq_len, outcome)
            return outcome

        search = find_max_seq_len(
            fits,
            cap_tokens=cap,
            step_tokens=step_tokens,
            known_fitting_tokens=known_fitting_tokens,
        )
        logger.info(
            "checkpointing=%s: longest sequence %d after %d trials",
            checkpointing,
            search.max_seq_len,
            len(search.attempts),
        )
        return SequenceModeProbe(
            checkpointing=checkpointing,
            max_seq_len=search.max_seq_len,
            capped=search.capped,
            attempts=[
                SequenceTrial(
                    seq_len=a.seq_len, fits=a.outcome.fits, peak_bytes=a.outcome.peak_bytes
                )
                for a in search.attempts
            ],
        )

    results: list[SequenceModeProbe] = []
    known_fitting_tokens = 0
    for checkpointing in modes:
        if checkpointing and supports_checkpointing and not supports_checkpointing[0]:
            logger.warning("this model cannot toggle gradient checkpointing; searching without")
            continue
        mode = search_mode(checkpointing, known_fitting_tokens)
        results.append(mode)
        # Checkpointing only removes saved activations: the plain answer is a first guess.
        known_fitting_tokens = max(known_fitting_tokens, mode.max_seq_len)
    return SequenceProbeResult(
        device=device[0],
        micro_batch=micro_batch,
        step_tokens=step_tokens,
        cap_tokens=cap,
        modes=results,
    )


__all__ = [
    "CheckpointingUnsupported",
    "model_positions",
    "probe_max_seq_len",
    "sequence_cap",
    "sequence_trial",
]
