"""A worker's answer where micro-batch 1 fits in no mode carries what would make it fit, traced
in the worker under the estimate's limits, stored and served with the run (the worker runs in
this process against the in-process app)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.schemas import Spec
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EstimateTarget, RunStatus
from probes.worker import RunOutcome
from tests.probes_tests.test_estimate_limits import _worker

pytestmark = pytest.mark.slow

# Two layers (seconds to trace) but 2.2B parameters: 36 GB of fp32 weights, gradients and
# AdamW states, far past a T4's 15 GiB, and 18 GB with bf16 weights; LoRA fits it (its
# frozen fp32 weights are 9 GB), and so does ZeRO-3 on a few T4s. (With Llama-3's vocabulary
# of 128,256 the root unit alone, embeddings and head, would hold 2.1B parameters, which
# FSDP2 gathers whole as every export wraps it: no count of T4s fits that one.)
WIDE_SPEC = {
    "model": {
        "hf_config": {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_size": 8192,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 28672,
            "vocab_size": 32000,
        }
    },
    "training": {"seq_len": 16, "precision": "bf16"},
}


@pytest.mark.e2e  # a dozen changes traced on a 3.7B model: minutes on 2 cores
def test_an_estimate_that_fits_nowhere_is_answered_with_what_would_make_it_fit(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    run_id = user.submit_run(Spec.model_validate(WIDE_SPEC), EstimateTarget(gpu="T4")).id
    estimates = _worker(worker, tmp_path, estimate_time_limit_s=600.0)
    assert estimates.run_once() is RunOutcome.SUCCEEDED
    run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED
    assert [mode.max_micro_batch for mode in run.modes] == [0, 0]
    advice = run.fit_advice
    assert advice is not None, run
    changes = [remedy.change for remedy in advice.remedies]
    assert "LoRA rank 16 on all linear layers" in changes
    assert any("GPUs with ZeRO-3" in change for change in changes)
    assert "bf16 weights" in advice.still_too_large
    speeds = [remedy.samples_per_s for remedy in advice.remedies]
    assert all(speed is not None for speed in speeds)
    assert speeds == sorted(speeds, reverse=True)  # type: ignore[type-var]
    for remedy in advice.remedies:
        assert remedy.peak_bytes <= remedy.capacity_bytes
        per_gpu = remedy.samples_per_s_per_gpu
        assert per_gpu is not None and remedy.samples_per_s == pytest.approx(
            per_gpu * remedy.world_size
        )
