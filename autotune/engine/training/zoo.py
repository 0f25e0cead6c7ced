"""The built-in model zoo: one `nn.Module` per entry of `autotune.core.presets.PRESETS`.

Every model takes one input tensor and returns logits, has no dropout, and supports gradient
checkpointing (per transformer block, MLP hidden layer or CNN stage) through its
`gradient_checkpointing` attribute. Attention goes through `F.scaled_dot_product_attention` with
`is_causal=True` and dropout 0, so that on the CPU it takes the flash kernel, as a GPU would, and
not the math path that materialises (b, heads, s, s) probabilities
(docs/design.md#attention-kernels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autotune.core.presets import CNNPreset, DecoderPreset, MLPPreset, Preset
from autotune.engine.training.checkpointing import BlockCheckpointing, checkpoint_blocks

_INIT_STD = 0.02  # GPT-2's initialiser; also what HF Llama uses (initializer_range)


class CheckpointedStack(nn.Module):
    """A module list run in sequence, each entry checkpointable through
    `autotune.engine.training.checkpointing.checkpoint_blocks` (the helper factories use too),
    switched by the `gradient_checkpointing` attribute."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._checkpointing = checkpoint_blocks(self.layers)

    @property
    def checkpointing_switch(self) -> BlockCheckpointing:
        """The switch of its blocks' checkpointing (`checkpoint_blocks`)."""
        return self._checkpointing

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpointing.enabled

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self._checkpointing(enabled)

    def run_layers(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *extra)
        return x


# ---------------------------------------------------------------------------------------------
# GPT-2 style decoder (nanoGPT-like).


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))
        return out


class GPT2(CheckpointedStack):
    """LayerNorm, GELU MLP (4x), learned positions, lm_head tied to the token embedding."""

    def __init__(self, preset: DecoderPreset) -> None:
        super().__init__([GPT2Block(preset.d_model, preset.n_head) for _ in range(preset.n_layer)])
        self.max_seq_len = preset.max_seq_len
        self.wte = nn.Embedding(preset.vocab_size, preset.d_model)
        self.wpe = nn.Embedding(preset.max_seq_len, preset.d_model)
        self.ln_f = nn.LayerNorm(preset.d_model)
        self.lm_head = nn.Linear(preset.d_model, preset.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        _init_weights(self, residual_std=_INIT_STD / math.sqrt(2 * preset.n_layer))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        logits: torch.Tensor = self.lm_head(self.ln_f(self.run_layers(x)))
        return logits


# ---------------------------------------------------------------------------------------------
# Llama style decoder.


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, preset: DecoderPreset) -> None:
        super().__init__()
        d = preset.d_model
        self.n_head = preset.n_head
        self.n_kv_head = preset.n_kv_head or preset.n_head
        self.head_dim = d // preset.n_head
        ffn = preset.ffn_hidden or 4 * d
        self.attn_norm = nn.RMSNorm(d, eps=1e-5)
        self.q_proj = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-5)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # enable_gqa lets SDPA broadcast the kv heads instead of us materialising repeated copies,
        # the same choice transformers makes when there is no attention mask.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.0, is_causal=True, enable_gqa=self.n_kv_head != self.n_head
        )
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))
        h = self.mlp_norm(x)
        out: torch.Tensor = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return out


class Llama(CheckpointedStack):
    """RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, untied lm_head."""

    def __init__(self, preset: DecoderPreset, rope_theta: float = 10000.0) -> None:
        super().__init__([LlamaBlock(preset) for _ in range(preset.n_layer)])
        self.max_seq_len = preset.max_seq_len
        head_dim = preset.d_model // preset.n_head
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.embed_tokens = nn.Embedding(preset.vocab_size, preset.d_model)
        self.norm = nn.RMSNorm(preset.d_model, eps=1e-5)
        self.lm_head = nn.Linear(preset.d_model, preset.vocab_size, bias=False)
        _init_weights(self, residual_std=_INIT_STD)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Like transformers, the rotary tables are computed per forward in fp32 (small: s x hd).
        positions = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        logits: torch.Tensor = self.lm_head(self.norm(self.run_layers(x, cos, sin)))
        return logits


def _init_weights(model: nn.Module, residual_std: float) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith("_proj") else _INIT_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)


# ---------------------------------------------------------------------------------------------
# Classifiers over fixed-shape inputs.


class _MLPLayer(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class MLP(CheckpointedStack):
    """Flatten, then Linear-ReLU hidden layers, then a linear head.

    Checkpointing (per hidden layer) is supported but does not lower this model's peak: a
    Linear-ReLU layer keeps only its input and output, which its neighbours keep anyway, and
    recomputing one segment re-creates exactly what the plain backward holds (measured: equal
    peaks). The tuner then rightly finds checkpointing only slower here.
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int) -> None:
        widths = (in_features, *hidden)
        super().__init__([_MLPLayer(i, o) for i, o in zip(widths[:-1], widths[1:], strict=True)])
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.run_layers(x.flatten(1)))
        return logits


class _CNNStage(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        # ceil_mode keeps a 1-pixel map at 1 pixel instead of failing on small inputs.
        self.pool = nn.MaxPool2d(2, ceil_mode=True) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pool(F.relu(self.bn(self.conv(x))))
        return out


class CNN(CheckpointedStack):
    """Conv-BN-ReLU stages with 2x max pooling between them, global average pooling, a linear
    head. Under checkpointing, BatchNorm's running statistics are updated twice per step (once
    more in the recompute); that changes no gradient and no memory, only those buffers."""

    def __init__(self, in_channels: int, channels: tuple[int, ...], num_classes: int) -> None:
        widths = (in_channels, *channels)
        super().__init__(
            [
                _CNNStage(widths[i], widths[i + 1], pool=i < len(channels) - 1)
                for i in range(len(channels))
            ]
        )
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.run_layers(x).mean(dim=(2, 3))
        logits: torch.Tensor = self.head(features)
        return logits


def build_model(preset: Preset, input_shape: tuple[int, ...] | None = None) -> CheckpointedStack:
    """The module for a preset. `input_shape` (one sample's shape) overrides the preset's for
    MLP and CNN presets; the caller has checked it
    (`autotune.engine.training.workload.build_preset`)."""
    if isinstance(preset, DecoderPreset):
        return GPT2(preset) if preset.family == "gpt2" else Llama(preset)
    shape = input_shape or preset.input_shape
    if isinstance(preset, MLPPreset):
        return MLP(math.prod(shape), preset.hidden, preset.num_classes)
    assert isinstance(preset, CNNPreset)
    return CNN(shape[0], preset.channels, preset.num_classes)
