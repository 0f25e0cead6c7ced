"""Training the embeddings and the head beside LoRA adapters (`modules_to_save`), as the
`autotune` command runs it: in a child process, which crashed (a segfault or a corrupted heap,
exit 139 or 134) when the estimate's trace deep-copied its fake-tensor mode with the saved
modules (autotune/engine/estimate.py). Every command must exit 0 with a sensible answer: the
probe's fit and the tuner's recommendation, on the emulated GPU and in estimates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cli-saved-modules")]

GIB = 2**30
# The models of issue 23: the README's Llama (examples/llama-hf-config.yaml) and a Qwen2 7B.
EXAMPLE_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
}
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
}
TINY_QWEN2 = {**TINY_LLAMA_CONFIG, "model_type": "qwen2"}
HEAD_ONLY = {"r": 8, "alpha": 16, "target_modules": "all-linear", "modules_to_save": ["lm_head"]}
EMBEDDINGS_AND_HEAD = {
    "r": 64,
    "alpha": 128,
    "target_modules": "all-linear",
    "modules_to_save": ["embed_tokens", "lm_head"],
}


def autotune(tmp_path: Path, *args: str, config: dict[str, Any], **training: Any) -> Any:
    """`autotune ARGS spec` in a child process, for a spec of `config` and `training`; its JSON
    answer once it exited 0."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"hf_config": config}, "training": training}))
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli.main", *args, "--json", str(spec)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_probe_estimate_of_bf16_weights_trains_embeddings_and_head(tmp_path: Path) -> None:
    """The Qwen2 7B case of issue 23 on tiny shapes (bf16 weights, embeddings and head saved),
    which crashed 3 runs of 3 in fake-tensor dispatch."""
    result = autotune(
        tmp_path,
        "probe",
        "--estimate",
        "A100 80GB",
        config=TINY_QWEN2,
        seq_len=16,
        precision="bf16",
        weights="bf16",
        max_micro_batch=64,
        lora={**EMBEDDINGS_AND_HEAD, "r": 4, "alpha": 8},
    )
    assert [mode["max_micro_batch"] for mode in result["modes"]] == [64, 64]


@pytest.mark.e2e
@pytest.mark.parametrize(("seq_len", "maxima"), [(256, (29, 106)), (4096, (1, 6))])
def test_a_probe_estimate_of_a_qwen2_7b_trains_embeddings_and_head(
    tmp_path: Path, seq_len: int, maxima: tuple[int, int]
) -> None:
    """Issue 23's command: exit 139 within 6 s at both lengths."""
    result = autotune(
        tmp_path,
        "probe",
        "--estimate",
        "A100 80GB",
        config=QWEN2_7B,
        seq_len=seq_len,
        precision="bf16",
        weights="bf16",
        lora=EMBEDDINGS_AND_HEAD,
    )
    assert tuple(mode["max_micro_batch"] for mode in result["modes"]) == maxima
    # The resident state: bf16 weights (7.6 B), the trained copies of the embeddings and the
    # head (2 x 0.62 B) with their gradients and AdamW's two bf16 moments, and the adapters.
    resident = result["modes"][0]["attempts"][0]["phase_peak_bytes"]["optimizer"]
    assert 25 * GIB < resident < 30 * GIB


@pytest.mark.e2e
@pytest.mark.parametrize("device", [["--memory", "1GiB"], ["--estimate", "A100 80GB"]])
def test_tune_with_bf16_autocast_trains_the_head_beside_adapters(
    tmp_path: Path, device: list[str]
) -> None:
    """Issue 23's command: the emulated GPU segfaulted (3 of 3), the estimate aborted at exit
    once its JSON was printed (6 of 6)."""
    result = autotune(
        tmp_path,
        "tune",
        *device,
        "--db",
        f"sqlite:///{tmp_path / 'runs.db'}",
        config=EXAMPLE_LLAMA,
        seq_len=128,
        precision="bf16",
        target_global_batch=32,
        lora=HEAD_ONLY,
    )
    recommendation = result["recommendation"]
    assert recommendation["global_batch"] == 32
    assert 0 < recommendation["peak_bytes"] <= recommendation["capacity_bytes"]
    assert recommendation["samples_per_s"] > 0
