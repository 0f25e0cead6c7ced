"""How long the README's first commands take on this machine, run as a new user runs them: the
`autotune` command in a fresh process, wall-clock time from start to exit (interpreter start,
imports, model build, every trial). The README's figures for "a Llama-3-8B config" and the
example's probe come from here; it writes bench/results/first_hour.{json,md}.

    .venv/bin/python bench/first_hour.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LLAMA_3_8B_SPEC = """model:
  hf_config:
    model_type: llama
    hidden_size: 4096
    intermediate_size: 14336
    num_hidden_layers: 32
    num_attention_heads: 32
    num_key_value_heads: 8
    vocab_size: 128256
    max_position_embeddings: 8192
    rope_theta: 500000.0
    tie_word_embeddings: false
training:
  seq_len: 4096
  precision: bf16
  optimizer: adamw
  target_global_batch: 32
"""

# (name, argv after `autotune`, with {example} and {llama} standing for the spec files)
COMMANDS = [
    (
        "probe examples/gpt2-tiny.yaml, emulated 1 GiB",
        ["probe", "{example}", "--device", "cpu", "--memory", "1GiB", "--json"],
    ),
    (
        "probe Llama-3-8B config --estimate H100",
        ["probe", "{llama}", "--estimate", "H100 80GB", "--json"],
    ),
]


def run_once(argv: list[str], cwd: Path) -> float:
    start_s = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli.main", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    elapsed_s = time.perf_counter() - start_s
    if done.returncode != 0:
        raise RuntimeError(f"autotune {' '.join(argv)} exited {done.returncode}:\n{done.stderr}")
    return elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cwd = Path(folder)
        (cwd / "llama-3-8b.yaml").write_text(LLAMA_3_8B_SPEC)
        paths = {"example": str(REPO / "examples" / "gpt2-tiny.yaml"), "llama": "llama-3-8b.yaml"}
        for name, argv in COMMANDS:
            filled = [arg.format(**paths) for arg in argv]
            times_s = [run_once(filled, cwd) for _ in range(args.repeats)]
            rows.append(
                {
                    "command": name,
                    "argv": filled,
                    "seconds": [round(t, 1) for t in times_s],
                    "median_s": round(statistics.median(times_s), 1),
                }
            )
            print(f"{name}: {rows[-1]['seconds']} s", flush=True)
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "first_hour.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# The README's first commands, wall clock",
        "",
        f"`bench/first_hour.py`: each command {args.repeats} times in a fresh process on "
        f"{machine['cpus']} CPUs ({machine['platform']}, load average at the end "
        f"{machine['load_average_at_end']}), from start to exit.",
        "",
        "| command | runs (s) | median (s) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {row['command']} | {', '.join(str(s) for s in row['seconds'])} | {row['median_s']} |"
        for row in rows
    ]
    (RESULTS / "first_hour.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
