"""The README's screenshots of the web pages, from a real run: `make screenshots`
(`python -m tests.screenshots`).

Starts `autotune serve` on a fresh SQLite file and an `autotune worker` on an emulated 1 GiB GPU,
tunes examples/gpt2-tiny.yaml and a checkpointing-bound variant of it, then opens the list of
runs and the first run's page in Debian's headless Chromium (Playwright) and writes
docs/images/runs-list.png and docs/images/run-page.png. Nothing is left running.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from api.web.pages import TOKEN_COOKIE
from autotune.core.bytesize import parse_bytes
from autotune.core.specfile import load_spec
from autotune.remote.client import ServerClient, ServerError
from autotune.remote.protocol import CudaTarget, EmulatedTarget
from tests.browser import CHROMIUM_ARGS, chromium_path

ROOT = Path(__file__).resolve().parents[1]


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "autotune.cli.main", *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--memory", default="1GiB")
    args = parser.parse_args()
    chromium = chromium_path()
    if not chromium:
        print("no Chromium: install Debian's chromium package", file=sys.stderr)
        return 2
    data = Path(tempfile.mkdtemp(prefix="autotune-screens-"))
    client_token, worker_token = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    port = 20000 + os.getpid() % 10000
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "AUTOTUNE_DATA_DIR": str(data),
        "AUTOTUNE_CLIENT_TOKENS": client_token,
        "AUTOTUNE_WORKER_TOKENS": worker_token,
        "AUTOTUNE_TOKEN": worker_token,
    }
    env.pop("AUTOTUNE_DATABASE_URL", None)
    children = [_start(["serve", "--port", str(port), "--no-estimates"], env, data / "server.log")]
    try:
        user = ServerClient(url, token=client_token)
        deadline_s = time.monotonic() + 60
        while True:
            try:
                user.health()
                break
            except ServerError:
                if time.monotonic() > deadline_s:
                    raise
                time.sleep(0.2)
        worker_argv = ["worker", "--server", url, "--device", "cpu", "--memory", args.memory]
        worker_argv += ["--data-dir", str(data), "--poll-interval", "0.5"]
        children.append(_start(worker_argv, env, data / "worker.log"))
        spec = load_spec(ROOT / "examples" / "gpt2-tiny.yaml")
        target = EmulatedTarget(memory_bytes=parse_bytes(args.memory))
        # The longest sequence the preset takes: a smaller plain maximum, so checkpointing counts.
        longer = spec.model_copy(
            update={"training": spec.training.model_copy(update={"seq_len": 256})}
        )
        run_ids = [user.submit_run(s, target).id for s in (spec, longer)]
        # Runs no worker here takes, to show the list's other states: one waits for an H100,
        # one was cancelled.
        h100 = CudaTarget(name="NVIDIA H100 80GB HBM3", memory_bytes=80 * 2**30)
        user.submit_run(spec, h100)
        user.cancel_run(user.submit_run(longer, h100).id)
        for run_id in run_ids:
            run = user.wait_for_run(run_id, timeout_s=900)
            print(f"run {run_id}: {run.status.value}", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1200, "height": 800})
            context.add_cookies([{"name": TOKEN_COOKIE, "value": client_token, "url": url}])
            page = context.new_page()
            page.goto(url)
            page.screenshot(path=str(args.out / "runs-list.png"))
            page.goto(f"{url}/runs/{run_ids[0]}")
            # The recommendation, the exports and both plots: the page down to its tables.
            bottom = page.evaluate(
                "document.getElementById('attempts-h').getBoundingClientRect().top + scrollY"
            )
            page.set_viewport_size({"width": 1200, "height": int(bottom)})
            page.screenshot(path=str(args.out / "run-page.png"))
            browser.close()
        print(f"wrote {args.out / 'runs-list.png'} and {args.out / 'run-page.png'}")
        return 0
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
