"""The README's factory example, extracted from README.md and run as written, so that the docs
cannot drift from the code: it imports, validates, trains, counts its items as its loss does,
and its checkpointing switch saves memory."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from autotune.core.specfile import load_spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.runner import InProcessRunner

README = Path(__file__).resolve().parents[3] / "README.md"


def _block(first_line: str) -> str:
    """The fenced code block of the README whose first line is `first_line`."""
    blocks = re.findall(r"```\w*\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [block] = [b for b in blocks if b.startswith(first_line + "\n")]
    return str(block)


def test_the_readme_factory_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_factory.py").write_text(_block("# my_factory.py"))
    (tmp_path / "spec.yaml").write_text(_block("# spec.yaml, next to my_factory.py"))
    command = _block("PYTHONPATH=. autotune probe spec.yaml --device cpu --memory 1GiB")
    assert command.startswith("PYTHONPATH=. ")  # the README says how the module is found
    spec = load_spec(tmp_path / "spec.yaml")
    monkeypatch.syspath_prepend(tmp_path)  # what PYTHONPATH=. does
    monkeypatch.delitem(sys.modules, "my_factory", raising=False)
    try:
        session = InProcessRunner(spec, EmulatedDevice(1 << 40))
        workload = session.workload
        seq_len = spec.training.seq_len
        assert seq_len is not None and workload.tokens_per_sample == seq_len
        batch = workload.make_batch(3, torch.device("cpu"))
        assert workload.num_items(batch) == 3 * (seq_len - 1)  # next-token labels
        loss_per_item = workload.loss_sum(workload.model, batch).item() / 3 / (seq_len - 1)
        assert loss_per_item == pytest.approx(math.log(256), rel=0.2)
        assert session.supports_checkpointing
        session.warm_up(checkpointing=False)
        plain = session.trial(8, checkpointing=False)
        checkpointed = session.trial(8, checkpointing=True)
        assert plain.fits and checkpointed.fits
        assert checkpointed.peak_bytes < plain.peak_bytes
    finally:
        sys.modules.pop("my_factory", None)
