"""`make run` (python -m autotune.cli.demo) as a user runs it: a child process that starts a
server and a worker, submits a spec, prints the result and, with --stop, stops everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
import yaml

from tests.probes_tests.factories import wide_spec
from tests.probes_tests.live import MARK_VARIABLE, REPO, kill_marked, new_mark, wait_for_no_marked

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _demo(
    tmp_path: Path, mark: str, *args: str, target_global_batch: int | None = 32
) -> subprocess.Popen[str]:
    spec_path = tmp_path / "spec.yaml"
    spec = wide_spec(features=16, target_global_batch=target_global_batch).model_dump(
        mode="json", exclude_defaults=True
    )
    spec_path.write_text(yaml.safe_dump(spec))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune.cli.demo",
            "--spec",
            str(spec_path),
            "--memory",
            "5MiB",
            "--data-dir",
            str(tmp_path / "data"),
            "--seconds-per-trial",
            "0.1",
            "--start-method",
            "forkserver",
            *args,
        ],
        cwd=REPO,
        env={**os.environ, MARK_VARIABLE: mark, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_demo_with_stop_prints_the_result_and_leaves_no_process(tmp_path: Path) -> None:
    mark = new_mark()
    demo = _demo(tmp_path, mark, "--stop")
    try:
        out, err = demo.communicate(timeout=180)
    finally:
        if demo.poll() is None:
            demo.kill()
            kill_marked(mark)
    assert demo.returncode == 0, out + err
    assert re.search(r"Recommendation: micro-batch \d+ x \d+ accumulation steps", out), out
    assert "global batch 32" in out
    assert "per_device_train_batch_size" in out and "train_micro_batch_size_per_gpu" in out
    url = re.search(r"Run URL: (http://127\.0\.0\.1:\d+/api/v1/runs/1)", out)
    assert url is not None, out
    assert "emulates a GPU of 5.00 MiB" in out
    assert re.search(r"client token: \S+", out) and re.search(r"worker token: \S+", out)
    # Progress arrived while the run ran, not only at the end.
    assert "micro-batch" in err and "run 1: running" in err and "run 1: succeeded" in err
    assert wait_for_no_marked(mark, timeout_s=60) == []  # polled: reaping takes seconds under load
    with pytest.raises(httpx2.TransportError):  # the server is gone too
        httpx2.get(url[1], timeout=2)
    assert (tmp_path / "data" / "autotune.db").exists()

    # A second demo on the same data answers from the finished run at once.
    again = _demo(tmp_path, mark, "--stop")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, out + err
    assert "finished before" in out and "Recommendation" in out
    assert wait_for_no_marked(mark, timeout_s=60) == []


def test_demo_keeps_the_server_until_ctrl_c(tmp_path: Path) -> None:
    mark = new_mark()
    demo = _demo(tmp_path, mark, target_global_batch=None)  # a probe: quicker than a tuning
    try:
        assert demo.stdout is not None
        lines = []
        deadline_s = time.monotonic() + 180
        while time.monotonic() < deadline_s:
            line = demo.stdout.readline()
            lines.append(line)
            if "press Ctrl-C" in line or not line:
                break
        text = "".join(lines)
        url = re.search(r"Run URL: (\S+)", text)
        assert url is not None, text
        assert "max micro-batch" in text  # a spec without a target is probed, not tuned
        assert httpx2.get(url[1], timeout=5).status_code in (200, 401)  # still serving
        page = re.search(r"Web page: (http://127\.0\.0\.1:\d+/runs/1) ", text)
        assert page is not None, text
        asked = httpx2.get(page[1], timeout=5)  # the browser is asked for the token
        assert asked.status_code == 401 and 'name="token"' in asked.text
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=180) == 0
        assert wait_for_no_marked(mark, timeout_s=60) == []
    finally:
        if demo.poll() is None:
            demo.kill()
        kill_marked(mark)
