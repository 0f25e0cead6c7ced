"""The recommendation's choice (autotune/core/tuning/ranking.py): the fastest, unless a simpler
configuration is within the measured noise of it."""

from __future__ import annotations

from autotune.core.schemas import Trial, TrialState
from autotune.core.tuning.ranking import choose, recommendable, ties_with


def measured(
    number: int, micro: int, accumulation: int, speed: float, spread: float, *, ckpt: bool = False
) -> Trial:
    return Trial(
        number=number,
        micro_batch=micro,
        accumulation_steps=accumulation,
        checkpointing=ckpt,
        state=TrialState.COMPLETE,
        samples_per_s=speed,
        step_time_s=micro * accumulation / speed,
        step_time_spread=spread,
        timed_steps=3,
        peak_bytes=1,
    )


def test_within_the_noise_fewer_accumulation_steps_win() -> None:
    # gpt2-tiny on 1 GiB gave 32 x 2, then 16 x 4: 3 % apart with 10 % spreads.
    fewer = measured(0, 32, 2, 100.0, 0.10)
    faster = measured(1, 16, 4, 103.0, 0.10)
    assert ties_with(fewer, faster)
    assert choose([faster, fewer]) is fewer
    assert choose([fewer, faster]) is fewer


def test_within_the_noise_no_checkpointing_wins_over_fewer_steps() -> None:
    # llama-tiny on 1 GiB: 2 x 24 checkpointed although 47 fits plain.
    plain = measured(0, 47, 1, 95.0, 0.08)
    checkpointed = measured(1, 2, 24, 99.0, 0.08, ckpt=True)
    assert choose([checkpointed, plain]) is plain


def test_a_difference_beyond_the_noise_is_kept() -> None:
    slow = measured(0, 32, 2, 100.0, 0.02)
    fast = measured(1, 16, 4, 120.0, 0.02)
    assert not ties_with(slow, fast)
    assert choose([slow, fast]) is fast


def test_no_spread_means_no_tie() -> None:
    assert choose([measured(0, 32, 2, 100.0, 0.0), measured(1, 16, 4, 100.5, 0.0)]).number == 1
    assert choose([]) is None


def test_recommendable_keeps_the_headroom_when_it_can() -> None:
    roomy = measured(0, 8, 4, 90.0, 0.0).model_copy(update={"peak_bytes": 800})
    tight = measured(1, 16, 2, 120.0, 0.0).model_copy(update={"peak_bytes": 990})
    out_of_memory = Trial(
        number=2, micro_batch=32, accumulation_steps=1, checkpointing=False, state=TrialState.OOM
    )
    trials = [roomy, tight, out_of_memory]
    assert recommendable(trials, budget_bytes=900) == [roomy]
    # Nothing within the headroom: every complete trial, never one that ran out.
    assert recommendable(trials, budget_bytes=500) == [roomy, tight]
    assert recommendable([out_of_memory], budget_bytes=900) == []
