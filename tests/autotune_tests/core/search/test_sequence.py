"""The longest-sequence search (autotune/core/search/sequence.py): the micro-batch's search over
multiples of a step of tokens, exact against a fake capacity for every answer, within its
trial budget, never past the cap."""

from __future__ import annotations

import pytest

from autotune.core.schemas import StepOutcome
from autotune.core.search.sequence import find_max_seq_len


def _quadratic_device(limit_bytes: int, tried: list[int]) -> object:
    """Memory like eager attention's: a constant, a linear and a quadratic term in tokens."""

    def fits(seq_len: int) -> StepOutcome:
        tried.append(seq_len)
        peak = 1_000 + 30 * seq_len + seq_len * seq_len // 16
        return StepOutcome(micro_batch=1, fits=peak <= limit_bytes, peak_bytes=peak)

    return fits


@pytest.mark.parametrize("step_tokens", [64, 100, 1])
@pytest.mark.parametrize("limit_bytes", [500, 6_000, 40_000, 333_333, 2_000_000])
def test_the_answer_is_the_longest_fitting_multiple_of_the_step(
    step_tokens: int, limit_bytes: int
) -> None:
    cap_tokens = 4096
    tried: list[int] = []
    result = find_max_seq_len(
        _quadratic_device(limit_bytes, tried),  # type: ignore[arg-type]
        cap_tokens=cap_tokens,
        step_tokens=step_tokens,
    )
    fitting = [
        s
        for s in range(step_tokens, cap_tokens + 1, step_tokens)
        if 1_000 + 30 * s + s * s // 16 <= limit_bytes
    ]
    assert result.max_seq_len == max(fitting, default=0)
    assert result.capped == (result.max_seq_len == cap_tokens // step_tokens * step_tokens)
    assert all(s % step_tokens == 0 and s <= cap_tokens for s in tried)
    assert len(tried) == len(set(tried))  # no length twice
    assert [a.seq_len for a in result.attempts] == tried
    units = cap_tokens // step_tokens
    assert len(tried) <= (units - 1).bit_length() + 2 + 1
    # Certified: the answer fitted and the next multiple did not (unless it is the cap).
    verdicts = {a.seq_len: a.outcome.fits for a in result.attempts}
    if result.max_seq_len:
        assert verdicts[result.max_seq_len]
    if not result.capped:
        assert verdicts[result.max_seq_len + step_tokens] is False


def test_a_length_known_to_fit_is_tried_first() -> None:
    tried: list[int] = []
    result = find_max_seq_len(
        _quadratic_device(200_000, tried),  # type: ignore[arg-type]
        cap_tokens=8192,
        known_fitting_tokens=1024,
    )
    assert tried[0] == 1024
    assert result.max_seq_len == 1536  # 1000 + 30 * 1536 + 1536^2 / 16 = 194,536 <= 200,000


@pytest.mark.parametrize(
    ("cap_tokens", "step_tokens", "message"),
    [(32, 64, "below one step"), (4096, 0, "step_tokens must be >= 1")],
)
def test_a_cap_below_one_step_is_refused(cap_tokens: int, step_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find_max_seq_len(
            lambda s: StepOutcome(micro_batch=1, fits=True, peak_bytes=0),
            cap_tokens=cap_tokens,
            step_tokens=step_tokens,
        )
