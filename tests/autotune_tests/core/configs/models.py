"""Tiny local model directories (a transformers `config.json` each) that stand in for the hub
models the real configs name: the architecture of the named family, at test size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

TINY_QWEN3_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
DATA = Path(__file__).resolve().parents[3] / "data"
AXOLOTL_EXAMPLES = DATA / "axolotl"


def model_directory(root: Path, config: dict[str, Any], **changes: Any) -> Path:
    directory = root / f"tiny-{config['model_type']}"
    directory.mkdir()
    # What save_pretrained writes besides the architecture: dropped on reading.
    saved = {**config, **changes, "_name_or_path": "somewhere/else", "architectures": ["X"]}
    (directory / "config.json").write_text(json.dumps(saved))
    return directory


def tiny_llama_directory(root: Path, **changes: Any) -> Path:
    return model_directory(root, TINY_LLAMA_CONFIG, **changes)


def tiny_qwen3_directory(root: Path, **changes: Any) -> Path:
    return model_directory(root, TINY_QWEN3_CONFIG, **changes)
