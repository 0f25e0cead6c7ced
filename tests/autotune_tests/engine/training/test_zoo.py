"""The model zoo: every preset trains, has the right size, and checkpoints correctly."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from autotune.core.presets import PRESETS, DecoderPreset
from autotune.engine.training.workload import Workload, build_preset
from autotune.engine.training.zoo import build_model

TINY_SEQ_LEN = 8


def _tiny_workload(name: str) -> Workload:
    is_decoder = isinstance(PRESETS[name], DecoderPreset)
    return build_preset(name, seq_len=TINY_SEQ_LEN if is_decoder else None)


def _loss_and_grads(
    workload: Workload, batch: object, checkpointing: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = workload.model.train()
    assert workload.set_checkpointing is not None
    workload.set_checkpointing(checkpointing)
    model.zero_grad(set_to_none=True)
    loss = workload.loss_sum(model, batch)
    torch.autograd.backward(loss)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _tracked_peak_bytes(workload: Workload, batch: object, checkpointing: bool) -> int:
    assert workload.set_checkpointing is not None
    workload.set_checkpointing(checkpointing)
    workload.model.zero_grad(set_to_none=True)
    tracker = MemTracker()  # one tracker per step: it refuses to see a root module run twice
    tracker.track_external(workload.model)
    with tracker:
        torch.autograd.backward(workload.loss_sum(workload.model, batch))
    workload.model.zero_grad(set_to_none=True)
    peak: int = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak


# The two small presets take half a minute each: they run with the slow end-to-end tests.
_SLOW_PRESETS = {"llama-small", "gpt2-small"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.e2e] if name in _SLOW_PRESETS else [])
        for name in PRESETS
    ],
)
def test_every_preset_runs_forward_and_backward(name: str) -> None:
    torch.manual_seed(0)
    workload = _tiny_workload(name)
    batch = workload.make_batch(2, torch.device("cpu"))
    loss, grads = _loss_and_grads(workload, batch, checkpointing=False)
    per_item = loss.item() / workload.num_items(batch)
    num_classes = getattr(PRESETS[name], "vocab_size", None) or PRESETS[name].num_classes  # type: ignore[union-attr]
    # An untrained model is close to uniform: about ln(classes) per item.
    assert per_item == pytest.approx(torch.log(torch.tensor(num_classes)).item(), rel=0.3)
    params = dict(workload.model.named_parameters())
    assert grads.keys() == params.keys()
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_gpt2_small_has_gpt2s_124m_parameters() -> None:
    with torch.device("meta"):  # sizes only: skip allocating and initialising 124M weights
        model = build_model(PRESETS["gpt2-small"])
    # GPT-2 small with tied lm_head and 1024 learned positions, as HF GPT2LMHeadModel counts it.
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_decoder_parameter_count_matches_transformers(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    preset = PRESETS[name]
    assert isinstance(preset, DecoderPreset)
    if preset.family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=preset.n_layer, n_head=preset.n_head, n_embd=preset.d_model,
            vocab_size=preset.vocab_size, n_positions=preset.max_seq_len,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=preset.n_layer, num_attention_heads=preset.n_head,
            num_key_value_heads=preset.n_kv_head, hidden_size=preset.d_model,
            intermediate_size=preset.ffn_hidden, vocab_size=preset.vocab_size,
            max_position_embeddings=preset.max_seq_len, tie_word_embeddings=False,
        )  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model(preset)
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in reference.parameters()
    )


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "mlp", "cnn"])
def test_checkpointing_keeps_loss_and_gradients(name: str) -> None:
    torch.manual_seed(0)
    workload = _tiny_workload(name)
    batch = workload.make_batch(3, torch.device("cpu"))
    loss_plain, grads_plain = _loss_and_grads(workload, batch, checkpointing=False)
    loss_ckpt, grads_ckpt = _loss_and_grads(workload, batch, checkpointing=True)
    torch.testing.assert_close(loss_ckpt, loss_plain)
    torch.testing.assert_close(grads_ckpt, grads_plain)


@pytest.mark.parametrize(
    ("name", "seq_len", "input_shape", "micro_batch"),
    [
        ("gpt2-tiny", 64, None, 4),
        ("llama-tiny", 64, None, 4),
        ("cnn", None, (3, 16, 16), 8),
    ],
)
def test_checkpointing_lowers_the_tracked_peak(
    name: str, seq_len: int | None, input_shape: tuple[int, ...] | None, micro_batch: int
) -> None:
    torch.manual_seed(0)
    workload = build_preset(name, seq_len=seq_len, input_shape=input_shape)
    workload.model.train()
    batch = workload.make_batch(micro_batch, torch.device("cpu"))
    plain_bytes = _tracked_peak_bytes(workload, batch, checkpointing=False)
    ckpt_bytes = _tracked_peak_bytes(workload, batch, checkpointing=True)
    print(f"{name}: peak {plain_bytes / 2**20:.2f} MiB plain, {ckpt_bytes / 2**20:.2f} MiB ckpt")
    assert ckpt_bytes < plain_bytes


def test_checkpointing_an_mlp_does_not_raise_the_peak() -> None:
    # Linear-ReLU layers keep only what their neighbours keep, so there is nothing to save;
    # what must not happen is a higher peak.
    torch.manual_seed(0)
    workload = build_preset("mlp")
    workload.model.train()
    batch = workload.make_batch(1024, torch.device("cpu"))
    plain_bytes = _tracked_peak_bytes(workload, batch, checkpointing=False)
    assert _tracked_peak_bytes(workload, batch, checkpointing=True) <= plain_bytes


def test_checkpointing_is_off_by_default_and_only_in_training() -> None:
    model = build_model(PRESETS["gpt2-tiny"])
    assert model.gradient_checkpointing is False
    model.gradient_checkpointing = True
    model.eval()
    with torch.no_grad():  # eval mode runs plainly even with the flag set
        logits = model(torch.zeros(1, 4, dtype=torch.int64))
    assert logits.shape == (1, 4, PRESETS["gpt2-tiny"].vocab_size)  # type: ignore[union-attr]
