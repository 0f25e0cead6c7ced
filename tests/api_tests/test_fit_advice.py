"""What would make a spec fit, as the server keeps and shows it: a worker's result where nothing
fits carries the remedies, the run serves them and its page lists them, on both databases."""

from __future__ import annotations

from html import unescape

import pytest
from starlette.testclient import TestClient

from autotune.core.remedies import NOT_MODELLED_OFFLOAD
from autotune.core.schemas import (
    FitAdvice,
    Infeasible,
    ModeProbe,
    ProbeResult,
    Remedy,
    TuneResult,
)
from autotune.remote.client import ServerClient
from tests.api_tests.factories import attempt, emulated, emulated_device, tiny_spec
from tests.api_tests.web.test_pages import _signed_in

pytestmark = pytest.mark.usefixtures("db_url")

ADVICE = FitAdvice(
    remedies=[
        Remedy(
            change="bf16 weights",
            spec_diff={"precision": "bf16", "weights": "bf16"},
            checkpointing=False,
            micro_batch=1,
            seq_len=64,
            world_size=1,
            peak_bytes=3 * 2**30,
            capacity_bytes=4 * 2**30,
        ),
        Remedy(
            change="LoRA rank 16 on all linear layers",
            spec_diff={"lora": {"r": 16, "alpha": 32.0}},
            checkpointing=True,
            micro_batch=1,
            seq_len=64,
            world_size=1,
            peak_bytes=2 * 2**30,
            capacity_bytes=4 * 2**30,
        ),
    ],
    still_too_large=["8-bit AdamW"],
    not_modelled=[NOT_MODELLED_OFFLOAD],
)


def _nothing_fits() -> TuneResult:
    spec, device = tiny_spec(), emulated_device()
    modes = [
        ModeProbe(
            checkpointing=checkpointing,
            max_micro_batch=0,
            recommended_micro_batch=0,
            capped=False,
            attempts=[attempt(1, False)],
        )
        for checkpointing in (False, True)
    ]
    return TuneResult(
        spec=spec,
        device=device,
        probe=ProbeResult(device=device, modes=modes, fit_advice=ADVICE),
        trials=[],
        recommendation=None,
        infeasible=Infeasible(reason="not even a micro-batch of 1 fits"),
    )


def test_the_remedies_are_stored_served_and_shown(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    result = _nothing_fits()
    run_id = user.submit_run(result.spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    worker.submit_result(run_id, claim.lease_id, result)
    assert user.get_run(run_id).fit_advice == ADVICE
    html = _signed_in(http).get(f"/runs/{run_id}").text
    table = html[
        html.index('id="fit-advice"') : html.index("</table>", html.index('id="fit-advice"'))
    ]
    assert table.count('<tr class="remedy">') == 2
    assert "training.precision: bf16, training.weights: bf16" in table
    assert 'training.lora: {"alpha": 32.0, "r": 16}' in unescape(table)
    assert "Still too large: 8-bit AdamW" in html
    assert "Not modelled: CPU offload of the optimizer states" in html
