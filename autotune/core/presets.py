"""The built-in model zoo as data: names and architecture sizes, torch-free.

`autotune.engine.training.zoo` turns these into `nn.Module`s; the API validates preset names
against this catalogue without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DecoderPreset:
    """A decoder-only language model. `family` picks GPT-2 (LayerNorm, GELU MLP, learned
    positions, tied embeddings) or Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention,
    untied head)."""

    family: Literal["gpt2", "llama"]
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int
    max_seq_len: int
    n_kv_head: int = 0  # llama only; 0 means n_head
    ffn_hidden: int = 0  # llama only; 0 means the GPT default 4 * d_model

    kind: Literal["decoder"] = "decoder"


@dataclass(frozen=True)
class MLPPreset:
    """A fully connected classifier over a flat (or flattened) input."""

    input_shape: tuple[int, ...]
    hidden: tuple[int, ...]
    num_classes: int

    kind: Literal["mlp"] = "mlp"


@dataclass(frozen=True)
class CNNPreset:
    """A small convolutional image classifier (conv-BN-ReLU stages, global pooling)."""

    input_shape: tuple[int, int, int]
    channels: tuple[int, ...]
    num_classes: int

    kind: Literal["cnn"] = "cnn"


Preset = DecoderPreset | MLPPreset | CNNPreset

PRESETS: dict[str, Preset] = {
    # GPT-2 style; gpt2-small is the 124M GPT-2.
    "gpt2-tiny": DecoderPreset(
        "gpt2", n_layer=4, n_head=4, d_model=256, vocab_size=8192, max_seq_len=256
    ),
    "gpt2-mini": DecoderPreset(
        "gpt2", n_layer=6, n_head=6, d_model=384, vocab_size=16384, max_seq_len=512
    ),
    "gpt2-small": DecoderPreset(
        "gpt2", n_layer=12, n_head=12, d_model=768, vocab_size=50257, max_seq_len=1024
    ),
    # Llama style; llama-small (99M parameters) has SmolLM-135M's width and heads, 12 layers.
    "llama-tiny": DecoderPreset(
        "llama",
        n_layer=4,
        n_head=4,
        d_model=256,
        vocab_size=8192,
        max_seq_len=256,
        n_kv_head=2,
        ffn_hidden=688,
    ),
    "llama-mini": DecoderPreset(
        "llama",
        n_layer=6,
        n_head=6,
        d_model=384,
        vocab_size=16384,
        max_seq_len=512,
        n_kv_head=2,
        ffn_hidden=1024,
    ),
    "llama-small": DecoderPreset(
        "llama",
        n_layer=12,
        n_head=9,
        d_model=576,
        vocab_size=49152,
        max_seq_len=2048,
        n_kv_head=3,
        ffn_hidden=1536,
    ),
    "mlp": MLPPreset(input_shape=(784,), hidden=(1024, 1024), num_classes=10),
    "cnn": CNNPreset(input_shape=(3, 32, 32), channels=(32, 64, 128), num_classes=10),
}
