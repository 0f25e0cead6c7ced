"""The tuner end to end on the emulated GPU: exact target batch, fits, explains what it cannot."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from autotune.core.exports import render_exports
from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.schemas import (
    AllocatorOption,
    DeviceInfo,
    DeviceKind,
    ModeProbe,
    ProbeResult,
    Recommendation,
    Spec,
    Trial,
    TrialState,
    TuneResult,
)
from autotune.core.tuning.candidates import Candidate
from autotune.core.tuning.ranking import choose, ties_with
from autotune.core.tuning.result_check import check_result
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.fit_points import TracedFitPoints
from autotune.engine.probe import ExpandableSegments
from autotune.engine.runner import InProcessRunner
from autotune.engine.tuner import (
    _recommend,
    _with_dips,
    default_trial_budget,
    priority_candidates,
    tune,
    tune_session,
)
from tests.probes_tests.factories import wide_spec

# The module's tunings are shared (`tuned`): its tests run in one xdist worker.
# Whole tunings on one xdist worker (one group): started first, so they are not the tail.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tuner")]

MiB = 2**20
SEQ_LEN = 32
CAPACITY_BYTES = 180 * MiB  # gpt2-tiny at 32 tokens: about 10 samples without checkpointing


def capacity_bytes(world_size: int) -> int:
    """One rank of several also holds DDP's gradient buckets (about 20 MiB for gpt2-tiny)."""
    return CAPACITY_BYTES if world_size == 1 else CAPACITY_BYTES + 30 * MiB


def tiny_spec(**training: object) -> Spec:
    settings: dict[str, object] = {"seq_len": SEQ_LEN, "max_micro_batch": 64, **training}
    return Spec.model_validate({"model": {"preset": "gpt2-tiny"}, "training": settings})


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tune.db'}"


Tuned = tuple[Spec, TuneResult, str]
STUDY_NAME = "my-study"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Tuned]:
    """Tunes each (target, world size) once per module, in a study named STUDY_NAME; returns
    the spec, the result and the study's storage URL. A tuning is the costly part of a test."""
    done: dict[tuple[int, int], Tuned] = {}

    def get(target: int, world_size: int) -> Tuned:
        if (target, world_size) not in done:
            # Several ranks state the target as LLM runs do, in tokens: the same samples.
            unit = "target_global_batch" if world_size == 1 else "target_global_tokens"
            amount = target if world_size == 1 else target * SEQ_LEN
            spec = tiny_spec(**{unit: amount}, world_size=world_size)
            url = sqlite_url(tmp_path_factory.mktemp("tune"))
            result = tune(
                spec,
                EmulatedDevice(capacity_bytes(world_size)),
                storage_url=url,
                study_name=STUDY_NAME,
                target_seconds=0.05,
            )
            done[target, world_size] = (spec, result, url)
        return done[target, world_size]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize(("target", "world_size"), [(32, 1), (24, 2)])
def test_recommendation_hits_the_target_exactly_and_fits(
    tuned: Callable[[int, int], Tuned], target: int, world_size: int
) -> None:
    spec, result, _ = tuned(target, world_size)

    rec = result.recommendation
    assert rec is not None
    assert rec.micro_batch * rec.accumulation_steps * rec.world_size == target
    assert rec.global_batch == target
    capacity = capacity_bytes(world_size)
    assert rec.peak_bytes <= int(capacity * (1 - spec.training.headroom))
    assert rec.samples_per_s > 0
    # It really fits: a fresh model on a fresh device runs that exact step.
    session = InProcessRunner(spec, EmulatedDevice(capacity))
    assert session.warm_up(checkpointing=rec.checkpointing).fits
    assert session.trial(
        rec.micro_batch, rec.accumulation_steps, checkpointing=rec.checkpointing
    ).fits
    # Every measured trial hits the target too, and the best one is the recommendation.
    complete = [t for t in result.trials if t.state is TrialState.COMPLETE]
    for trial in result.trials:
        assert trial.micro_batch * trial.accumulation_steps * world_size == target
    budget = int(capacity * (1 - spec.training.headroom))
    within = [t for t in complete if t.peak_bytes is not None and t.peak_bytes <= budget]
    # The fastest, or a simpler configuration within the measured noise of it.
    chosen = choose(within or complete)
    assert chosen is not None
    assert (chosen.micro_batch, chosen.accumulation_steps, chosen.checkpointing) == (
        rec.micro_batch,
        rec.accumulation_steps,
        rec.checkpointing,
    )
    fastest = max(within or complete, key=lambda t: t.samples_per_s or 0)
    assert chosen is fastest or ties_with(chosen, fastest)
    assert result.exports is not None
    assert result.exports.deepspeed["train_batch_size"] == target
    if spec.training.target_global_tokens is not None:
        assert result.exports.tokens_per_sample == SEQ_LEN
        assert rec.global_batch * SEQ_LEN == spec.training.target_global_tokens


@pytest.mark.e2e
def test_the_study_is_stored_for_the_dashboard(tuned: Callable[[int, int], Tuned]) -> None:
    _, result, url = tuned(32, 1)
    study = optuna.load_study(study_name=STUDY_NAME, storage=url)
    assert result.study_name == STUDY_NAME
    assert len({t.number for t in study.trials}) >= len(result.trials)


@pytest.mark.e2e
def test_accumulation_limit_is_found_and_respected(tuned: Callable[[int, int], Tuned]) -> None:
    _, result, _ = tuned(32, 1)
    for mode in result.probe.modes:
        assert mode.accumulating_micro_batch is not None
        # Gradients alive across micro-batches can only lower the limit.
        assert mode.accumulating_micro_batch <= mode.recommended_micro_batch
    limit = {m.checkpointing: m.accumulating_micro_batch for m in result.probe.modes}
    for trial in result.trials:
        assert trial.micro_batch <= (limit[trial.checkpointing] or 0)


@pytest.mark.e2e
def test_an_indivisible_target_is_explained_not_changed(tmp_path: Path) -> None:
    result = tune(
        tiny_spec(target_global_batch=7, world_size=2),
        EmulatedDevice(capacity_bytes(2)),
        storage_url=sqlite_url(tmp_path),
        target_seconds=0.05,
    )
    assert result.recommendation is None
    assert result.trials == []
    assert result.infeasible is not None
    assert "not divisible by world size 2" in result.infeasible.reason
    assert (result.infeasible.nearest_below, result.infeasible.nearest_above) == (6, 8)


def test_nothing_fits_is_explained(tmp_path: Path) -> None:
    result = tune(
        tiny_spec(target_global_batch=8), EmulatedDevice(MiB), storage_url=sqlite_url(tmp_path)
    )
    assert result.recommendation is None
    assert result.infeasible is not None
    assert "not even a micro-batch of 1 fits" in result.infeasible.reason


def test_a_target_that_needs_accumulation_that_does_not_fit_is_explained(tmp_path: Path) -> None:
    # At 129 MiB micro-batch 1 fits alone (reserving 122 MiB, within the 5 % headroom), but not
    # with an earlier micro-batch's gradients held, so the target 4 (4 x 1, accumulated) cannot
    # be reached; this raised ValueError before.
    spec = Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 8, "max_micro_batch": 1, "target_global_batch": 4},
        }
    )
    result = tune(spec, EmulatedDevice(129 * MiB), storage_url=sqlite_url(tmp_path))
    assert [
        (m.recommended_micro_batch, m.accumulating_micro_batch) for m in result.probe.modes
    ] == [
        (1, 0),
        (1, 0),
    ]
    assert result.recommendation is None and result.trials == []
    assert result.infeasible is not None
    assert "needs gradient accumulation" in result.infeasible.reason
    assert (result.infeasible.nearest_below, result.infeasible.nearest_above) == (1, None)


def test_priority_and_budget() -> None:
    candidates = [Candidate(b, 32 // b, False) for b in (1, 2, 4, 8)] + [
        Candidate(b, 32 // b, True) for b in (1, 2, 4, 8, 16)
    ]
    assert priority_candidates(candidates) == [
        Candidate(8, 4, False),
        Candidate(16, 2, True),
        Candidate(4, 8, False),
    ]
    # Checkpointing at a micro-batch that fits without it is never a priority.
    no_gain = [Candidate(4, 8, False), Candidate(4, 8, True), Candidate(2, 16, True)]
    assert priority_candidates(no_gain) == [Candidate(4, 8, False)]
    assert default_trial_budget(2) == 2
    assert default_trial_budget(9) == 3
    assert default_trial_budget(40) == 10


@pytest.mark.parametrize(
    ("world_size", "device"),
    [(1, ["--device", "cpu", "--memory", "64MiB"]), (2, ["--estimate", "H100 80GB"])],
)
@pytest.mark.e2e
def test_cli_tune_json(tmp_path: Path, world_size: int, device: list[str]) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        "model: {preset: mlp}\n"
        f"training: {{target_global_batch: 16, world_size: {world_size}}}\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli.main",
            "tune",
            str(spec_path),
            *device,
            "--json",
            "--db",
            sqlite_url(tmp_path),
            "--seconds-per-trial",
            "0.05",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert set(document) >= {"recommendation", "exports", "trials", "probe"}
    assert set(document["exports"]) >= {"hf", "axolotl", "deepspeed", "lightning"}
    rec = document["recommendation"]
    assert rec["micro_batch"] * rec["accumulation_steps"] * rec["world_size"] == 16
    assert "trial" in done.stderr  # progress on stderr
    complete = [t for t in document["trials"] if t["state"] == "complete"]
    assert complete
    for trial in complete:
        if world_size == 1:  # one rank, no communication
            assert trial["compute_time_s"] is None and trial["exposed_communication_s"] is None
            continue
        # Several ranks: the step is the compute plus what of the communication stays exposed.
        exposed_s = trial["exposed_communication_s"]
        assert 0 < exposed_s <= trial["communication_time_s"]
        assert trial["step_time_s"] == pytest.approx(trial["compute_time_s"] + exposed_s)
    assert ("communication" in done.stderr) is (world_size > 1)


@pytest.mark.e2e
def test_cli_tune_needs_a_target(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text("model: {preset: mlp}\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli.main",
            "tune",
            str(spec_path),
            "--device",
            "cpu",
            "--memory",
            "180MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "autotune: error: training.target_global_batch: required for tuning "
        "(or target_global_tokens)"
    )


def test_steps_that_fit_only_without_the_headroom_are_explained(tmp_path: Path) -> None:
    # The wide model reserves all of a 4 MiB card (2 MiB segments) at every micro-batch that
    # fits there: it fits, but never within 95 % of the capacity. This was reported as "not even
    # a micro-batch of 1 fits".
    spec = wide_spec(features=16, target_global_batch=32)
    result = tune(spec, EmulatedDevice(4 * MiB), storage_url=sqlite_url(tmp_path))
    assert result.recommendation is None and result.infeasible is not None
    [mode] = result.probe.modes
    assert mode.max_micro_batch > 1 and mode.recommended_micro_batch == 0
    assert result.infeasible.reason.startswith(
        f"micro-batches up to {mode.max_micro_batch} fit, but none leaves the 5% headroom free"
    )


@pytest.mark.parametrize(
    ("expandable_max", "expandable_dips", "recommended", "holds_for_expandable"),
    [(20, [], True, True), (17, [], True, False), (20, [9], True, False), (20, [], False, False)],
    ids=["dips-removed", "below-the-pick", "dips-left", "not-recommended"],
)
def test_a_recommendation_above_dips_holds_for_expandable_segments_that_remove_them(
    expandable_max: int, expandable_dips: list[int], recommended: bool, holds_for_expandable: bool
) -> None:
    conf = "expandable_segments:True"
    mode = ModeProbe(
        checkpointing=False,
        max_micro_batch=20,
        recommended_micro_batch=20,
        capped=False,
        attempts=[],
        runs_out_below=[10, 13],
        expandable_segments=AllocatorOption(
            allocator_conf=conf,
            traced_max_micro_batch=expandable_max,
            max_micro_batch=expandable_max,
            runs_out_below=expandable_dips,
            recommended=recommended,
        ),
    )
    device = DeviceInfo(
        kind=DeviceKind.EMULATED, name="cpu", total_memory_bytes=2000, capacity_bytes=2000
    )
    rec = Recommendation(
        micro_batch=18,
        accumulation_steps=1,
        checkpointing=False,
        world_size=1,
        global_batch=18,
        samples_per_s=1.0,
        peak_bytes=1000,
        capacity_bytes=2000,
    )
    chosen = _with_dips(rec, ProbeResult(device=device, modes=[mode]))
    if holds_for_expandable:
        assert chosen.allocator_conf == conf and chosen.runs_out_below == []
    else:
        assert chosen.allocator_conf is None and chosen.runs_out_below == [10, 13]


# ---------------------------------------------------------------------------------------------
# Expandable segments as a knob the tuner measures: candidates only they fit, timed under them.

EXPANDABLE = "expandable_segments:True"


def _tune_with_expandable_segments(tmp_path: Path, memory_bytes: int, target: int) -> TuneResult:
    """gpt2-tiny tuned on the emulated GPU as `autotune tune` does (traced fit points, each mode
    also under expandable segments, on a second emulated GPU with them), every byte usable."""
    spec = tiny_spec(target_global_batch=target, headroom=0.0)
    runner = InProcessRunner(spec, EmulatedDevice(memory_bytes))
    device = EmulatedDevice(memory_bytes, allocator_config=parse_alloc_conf(EXPANDABLE))
    expandable = InProcessRunner(spec, device)
    return tune_session(
        runner,
        storage_url=sqlite_url(tmp_path),
        target_seconds=0.05,
        tracer=TracedFitPoints(runner),
        expandable=ExpandableSegments(expandable, TracedFitPoints(expandable)),
    )


@pytest.mark.e2e
def test_a_micro_batch_only_expandable_segments_fit_is_measured_and_recommended(
    tmp_path: Path,
) -> None:
    """On 152 MiB gpt2-tiny checkpointed fits 22 under the default allocator and 25 under
    expandable segments (test_main's probe). Target 23 (a prime): the default allocator
    reaches it only as 1 x 23; 23 x 1 fits only under expandable segments, is measured under
    them, and wins by the micro-batch; the recommendation and every export say so."""
    result = _tune_with_expandable_segments(tmp_path, 152 * MiB, 23)

    checkpointed = result.probe.modes[1]
    option = checkpointed.expandable_segments
    assert option is not None and option.allocator_conf == EXPANDABLE
    assert (checkpointed.recommended_micro_batch, option.recommended_micro_batch) == (22, 25)
    under = {(t.micro_batch, t.checkpointing): t for t in result.trials}
    larger = under[(23, True)]
    assert larger.allocator_conf == EXPANDABLE and larger.state is TrialState.COMPLETE
    one_each = [t for (b, _), t in under.items() if b == 1]
    assert one_each and all(t.allocator_conf is None for t in one_each)
    # 23 samples per forward against 23 forwards of 1: faster on a quiet machine. On a shared
    # one whose load changes between trials the timings may not show it (1 x 23 checkpointed
    # measured 1.0 s after 23 x 1 took 2.7 s, spread 0.9, as the load average fell from 6 to
    # 2): then the tie rule leaves the allocator alone (`test_a_tie_leaves_the_allocator_alone`),
    # and the test says so instead of asserting what those timings do not show.
    fastest = max(result.trials, key=lambda t: t.samples_per_s or 0.0)
    if fastest is not larger or any(ties_with(t, larger) for t in one_each):
        pytest.skip("this machine's timings do not show 23 x 1 faster beyond their noise")
    rec = result.recommendation
    assert rec is not None
    assert (rec.micro_batch, rec.accumulation_steps, rec.checkpointing) == (23, 1, True)
    assert rec.allocator_conf == EXPANDABLE and rec.runs_out_below == option.runs_out_below
    exports = result.exports
    assert exports is not None and exports.allocator_conf == EXPANDABLE
    texts = render_exports(exports)
    for name, text in texts.items():
        if name == "deepspeed":
            continue  # JSON: its notes are in deepspeed_notes
        assert f"PYTORCH_ALLOC_CONF={EXPANDABLE}" in text or f'"{EXPANDABLE}"' in text, name
    assert check_result(result.spec, result) == []


@pytest.mark.e2e
def test_expandable_segments_that_fit_no_larger_micro_batch_leave_the_allocator_alone(
    tmp_path: Path,
) -> None:
    """On 140 MiB expandable segments fit less than the default allocator (12 plain where it
    fits 14): the traced step replayed under them says so, so no trial verifies them and they
    are not recommended. Target 7 (a prime: 7 x 1 or 1 x 7), which the default allocator fits
    at G = 1 and accumulating (1 with earlier gradients held, in both modes): every trial runs
    under it, and 7 x 1 without checkpointing is recommended with exports that set nothing."""
    # Before the emulated GPU placed the residents where the warm-up leaves them
    # (docs/design.md#the-caching-allocator-on-the-emulated-gpu), 124 MiB had the trace predict
    # more under them and trials find less (9 plain against 10). Placed, no capacity from 114 to
    # 148 MiB does; at 140 MiB trials under them confirm the trace (12 fits, 13 runs out).
    result = _tune_with_expandable_segments(tmp_path, 140 * MiB, 7)

    plain = result.probe.modes[0]
    option = plain.expandable_segments
    assert option is not None and option.traced_max_micro_batch is not None
    assert option.traced_max_micro_batch < plain.max_micro_batch
    assert option.max_micro_batch is None and option.trials == 0 and not option.recommended
    assert result.trials and all(t.allocator_conf is None for t in result.trials)
    rec = result.recommendation
    assert rec is not None and rec.allocator_conf is None
    assert (rec.micro_batch, rec.accumulation_steps, rec.checkpointing) == (7, 1, False)
    exports = result.exports
    assert exports is not None and exports.allocator_conf is None
    texts = render_exports(exports)
    assert not any("PYTORCH_ALLOC_CONF=" in text for text in texts.values())
    assert check_result(result.spec, result) == []


def test_a_tie_leaves_the_allocator_alone() -> None:
    """A trial under expandable segments is recommended when it is faster than every other
    beyond their measured noise; tied with one under the device's settings, that one is."""
    spec = tiny_spec(target_global_batch=23)
    plain = Trial(
        number=0,
        micro_batch=1,
        accumulation_steps=23,
        checkpointing=False,
        state=TrialState.COMPLETE,
        samples_per_s=10.0,
        step_time_s=2.3,
        step_time_spread=0.05,
        peak_bytes=100,
    )
    larger = plain.model_copy(
        update={
            "number": 1,
            "micro_batch": 23,
            "accumulation_steps": 1,
            "checkpointing": True,
            "allocator_conf": EXPANDABLE,
            "samples_per_s": 40.0,
            "step_time_s": 23 / 40.0,
        }
    )
    faster = _recommend([plain, larger], spec, capacity_bytes=1000, num_blocks=None)
    assert faster is not None and faster.allocator_conf == EXPANDABLE
    assert (faster.micro_batch, faster.checkpointing) == (23, True)
    noisy = larger.model_copy(update={"step_time_spread": 2.0})
    tied = _recommend([plain, noisy], spec, capacity_bytes=1000, num_blocks=None)
    assert tied is not None and tied.allocator_conf is None and tied.micro_batch == 1
