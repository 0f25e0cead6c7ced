"""`make run`: tune the example model on this machine and print the recommendation.

Uses the first CUDA device when there is one, otherwise an emulated GPU of `DEMO_MEMORY` on the
CPU. Run with `python -m autotune.demo`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from autotune.cli import main

EXAMPLE_SPEC = Path(__file__).resolve().parent.parent / "examples" / "gpt2-tiny.yaml"
DEMO_MEMORY = "1GiB"


def run_demo() -> int:
    import torch

    device_args = ["--device", "cuda"] if torch.cuda.is_available() else ["--device", "cpu"]
    if not torch.cuda.is_available():
        device_args += ["--memory", DEMO_MEMORY]
    return main(["probe", str(EXAMPLE_SPEC), *device_args])


if __name__ == "__main__":
    sys.exit(run_demo())
