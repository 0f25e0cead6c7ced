"""What you paste is what was measured: every spec kind's export, given to every consumer that
can run here, builds the run the engine measured for that spec (`roundtrip.measured`): the same
micro-batch, accumulation and ranks, autocast and gradient scaler, parameter and gradient dtypes,
optimizer class and state bytes per element, checkpointed layers, sharding stage and group, and
trained parameters. Each consumer is checked as deep as this CPU-only machine lets it run
(`consumers` says how deep); where a consumer cannot express a setup at all, `CANNOT_EXPRESS`
names the property it changes, and its text must say so (the README's export table lists them).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from autotune.core.exports import build_exports, render_exports
from autotune.core.schemas import Exports
from tests.autotune_tests.core.exports import consumers
from tests.autotune_tests.core.exports.roundtrip import CASES, Case, measured

TRANSFORMERS_VERSION = "5.24.0"
# Two workers share the matrix, each importing its libraries and measuring each case once: the
# torch-level consumers (loop, Lightning, DeepSpeed) and the Trainer-based ones (HF, Axolotl).
TORCH_GROUP = "export_roundtrip_torch"
HF_GROUP = "export_roundtrip_trainer"
# A few seconds per group for imports and the engine's runs: scheduled first.
pytestmark = pytest.mark.slow

_BF16_REDUCTIONS = "param_dtype=torch.bfloat16 reduce_dtype=torch.bfloat16"
# (consumer, case) -> {property: what the consumer builds instead of the measured value}, and
# the words its text uses to say so.
CANNOT_EXPRESS: dict[tuple[str, str], tuple[dict[str, Any], str]] = {
    # Axolotl's bf16/fp16 also load the weights in that dtype (its resolve_dtype).
    ("axolotl", "bf16-autocast"): ({"weights": ["bfloat16"]}, "Axolotl cannot express"),
    ("axolotl", "fp16"): ({"weights": ["float16"]}, "Axolotl cannot express"),
    ("axolotl", "combination"): ({"weights": ["bfloat16"]}, "Axolotl cannot express"),
    # ... and under FSDP2 accelerate's bf16 policy, which reduces gradients in bf16 too.
    ("axolotl", "zero3-bf16"): (
        {"weights": ["bfloat16"], "gathers": _BF16_REDUCTIONS},
        "reduces gradients in bfloat16",
    ),
    # optimizer: adamw_bnb_8bit is the Trainer's bitsandbytes AdamW(optim_bits=8), which keeps
    # the embeddings' states in 32 bits.
    ("axolotl", "adamw8bit"): ({"optimizer": "AdamW"}, "embeddings' states in 32 bits"),
    # DeepSpeed's bf16 runs bf16 weights without autocast, and keeps a master copy.
    ("deepspeed", "bf16-weights"): ({"autocast": None}, "cannot be expressed"),
    # A client optimizer: the notes name it, the JSON cannot.
    ("deepspeed", "adamw8bit"): ({"optimizer": None}, "bitsandbytes.optim.AdamW8bit"),
    ("deepspeed", "adamw8bit-zero3"): ({"optimizer": None}, "torchao.optim.AdamW8bit"),
    # torch_autocast gives the Linear weights one communication dtype for gathers and
    # reductions (read from DeepSpeed's engine in test_deepspeed_engine).
    ("deepspeed", "zero3-bf16"): ({"gathers": _BF16_REDUCTIONS}, "reduces their gradients in"),
    # MiCS is gone: ZeRO-3 over all ranks.
    ("deepspeed", "hybrid"): ({}, "Hybrid sharding (groups of 2) cannot be expressed"),
}


@functools.cache
def _measured(name: str) -> dict[str, Any]:
    return measured(CASES[name])


def _exports(case: Case) -> Exports:
    return build_exports(
        case.recommendation(),
        token_model=True,
        transformers_version=TRANSFORMERS_VERSION,
        training=case.spec(),
    )


def _expected(consumer: str, name: str, keys: set[str] | None = None) -> dict[str, Any]:
    expected = dict(_measured(name))
    differs, words = CANNOT_EXPRESS.get((consumer, name), ({}, ""))
    if differs:
        text = _all_text(_exports(CASES[name]), consumer)
        assert words in text, f"the {consumer} text must say it cannot express {name}"
    expected.update(differs)
    if keys is not None:
        expected = {key: expected[key] for key in keys}
    return expected


def _all_text(exports: Exports, consumer: str) -> str:
    texts = render_exports(exports)
    return "".join(text for key, text in texts.items() if key.startswith(consumer))


NAMES = list(CASES)
SHARDED = {"zero1", "zero2", "zero3", "zero3-bf16", "hybrid", "adamw8bit-zero3"}


# ---------------------------------------------------------------------------------------------
# The plain PyTorch loop: executed, on a fake process group for several ranks.


@pytest.mark.e2e
@pytest.mark.xdist_group(TORCH_GROUP)
@pytest.mark.parametrize("name", NAMES)
def test_the_pytorch_loop_runs_what_was_measured(name: str) -> None:
    case = CASES[name]
    assert consumers.loop_run(_exports(case), case) == _expected("pytorch_loop", name)


# ---------------------------------------------------------------------------------------------
# Hugging Face: the text executed, then Trainer.train() for one step on one rank; on several
# ranks the DeepSpeed config or accelerate's FSDP plugin it sets up.


@pytest.mark.e2e
@pytest.mark.xdist_group(HF_GROUP)
@pytest.mark.parametrize("name", [n for n in NAMES if n not in SHARDED])
def test_the_trainer_runs_what_was_measured(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    found = consumers.hf_run(_exports(case), case, str(tmp_path))
    expected = _expected("hf", name)
    if case.spec().world_size > 1:
        # One rank here: the ranks come from torchrun, DDP's bucket view from the text.
        assert "ddp_handler.gradient_as_bucket_view = True" in render_exports(_exports(case))["hf"]
        for key in ("world_size", "sharding"):
            del found[key], expected[key]
    if name == "fp16":
        # accelerate runs fp16 autocast and its GradScaler on CUDA only: on this CPU the args
        # say fp16 and the run is fp32.
        args = consumers.hf_objects(_exports(case), str(tmp_path))["args"]
        assert args.fp16 is True
        expected.update(autocast=None, grad_scaler=False)
    assert found == expected


@pytest.mark.xdist_group(HF_GROUP)
@pytest.mark.parametrize("name", sorted(SHARDED))
@pytest.mark.e2e
def test_the_trainer_arguments_shard_as_measured(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    found = consumers.hf_sharding(_exports(case), case, str(tmp_path))
    measured_run = _measured(name)
    if name == "zero1":
        # ZeRO-1 through DeepSpeed: its config as DeepSpeed parses it.
        assert found["zero_stage"] == 1
        assert found["world_size"] == measured_run["world_size"]
        assert found["optimizer"] == measured_run["optimizer"]
        keys = {"micro_batch", "accumulation", "autocast", "weights"}
    else:
        # FSDP2 as accelerate shards the model for the Trainer: its mesh and mixed precision.
        keys = {"micro_batch", "accumulation", "sharding", "gathers"}
    assert {key: found[key] for key in keys} == _expected("hf", name, keys)


# ---------------------------------------------------------------------------------------------
# Lightning: the module's configure_model / configure_optimizers as pasted, the Trainer's
# precision plugin and accumulation, one step; the strategy objects for several ranks.


@pytest.mark.e2e
@pytest.mark.xdist_group(TORCH_GROUP)
@pytest.mark.parametrize("name", NAMES)
def test_lightning_runs_what_was_measured(name: str) -> None:
    case = CASES[name]
    assert consumers.lightning_run(_exports(case), case) == _expected("lightning", name)


# ---------------------------------------------------------------------------------------------
# DeepSpeed: its config parser on the run's ranks.

_ZERO_STAGES = {"zero1 over": 1, "reshard_after_forward=False": 2, "reshard_after_forward=True": 3}


def _zero_stage(sharding: str) -> int:
    return next((stage for key, stage in _ZERO_STAGES.items() if key in sharding), 0)


@pytest.mark.xdist_group(TORCH_GROUP)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.e2e
def test_deepspeed_parses_what_was_measured(name: str) -> None:
    case = CASES[name]
    exports = _exports(case)
    found = consumers.deepspeed_properties(exports.deepspeed, case.spec().world_size)
    keys = {"micro_batch", "accumulation", "world_size", "autocast", "grad_scaler", "weights"}
    keys.add("optimizer")
    expected = _expected("deepspeed", name, keys)
    assert {key: found[key] for key in keys} == expected
    stage = _zero_stage(_measured(name)["sharding"])
    assert found["zero_stage"] == stage
    # ZeRO builds only its tested optimizers (torch's AdamW among them) unless told.
    assert found["untested_optimizer_allowed"] is (stage > 0 and expected["optimizer"] != "AdamW")
    if expected["optimizer"] == "SGD":
        assert found["optimizer_params"]["momentum"] == 0.9


# ---------------------------------------------------------------------------------------------
# Axolotl: its own validate_config, then the optimizer class and the adapters as its trainer
# builds them.


@pytest.mark.e2e
@pytest.mark.xdist_group(HF_GROUP)
@pytest.mark.parametrize("name", NAMES)
def test_axolotl_validates_what_was_measured(name: str, tmp_path: Path) -> None:
    pytest.importorskip("axolotl", reason="make env installs Axolotl's schema (no-deps)")
    case = CASES[name]
    found = consumers.axolotl_run(_exports(case), case, str(tmp_path))
    keys = {"micro_batch", "accumulation", "weights", "autocast", "optimizer"}
    if "trainable_params" in found:
        keys.add("trainable_params")
    if "sharding" in found:
        keys |= {"sharding", "gathers"}
    assert {key: found[key] for key in keys} == _expected("axolotl", name, keys)
    assert found["checkpointing"] is bool(_measured(name)["checkpointed"])
    if case.checkpointed_blocks is not None:
        # Partial checkpointing cannot be expressed: Axolotl checkpoints every layer.
        assert "Axolotl checkpoints every" in render_exports(_exports(case))["axolotl"]
    if found.get("optimizer") == "SGD":
        assert found["optimizer_momentum"] == 0.9
    if "sharding" not in keys and "zero1" in _measured(name)["sharding"]:
        assert found["zero_stage"] == 1
    if case.spec().target_global_tokens is not None:
        assert found["tokens_per_sample"] == case.spec().seq_len


# ---------------------------------------------------------------------------------------------
# 8-bit AdamW under FSDP2 is torchao's (bitsandbytes' does not support DTensors, and Axolotl
# refuses adamw_bnb_8bit with FSDP2): every consumer builds torchao's class for zero2/3/hybrid.


@pytest.mark.e2e
@pytest.mark.xdist_group(HF_GROUP)
@pytest.mark.parametrize("sharding", ["zero3", "hybrid"])
def test_sharded_8bit_adamw_is_torchaos_in_every_consumer(sharding: str, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    group = {"shard_group_size": 2} if sharding == "hybrid" else {}
    world = 4 if sharding == "hybrid" else 2
    case = Case({"world_size": world, "sharding": sharding, "optimizer": "adamw8bit", **group})
    exports = _exports(case)
    texts = render_exports(exports)
    torchao_class = "torchao.optim.AdamW8bit"
    # The plain loop: torchao's AdamW8bit on FSDP2's sharded parameters, one step.
    loop = consumers.loop_run(exports, case)
    assert loop["optimizer"] == "AdamW8bit" and "fsdp2" in loop["sharding"]
    assert "import torchao.optim" in texts["pytorch_loop"]
    # Hugging Face: the optim the Trainer builds torchao's class from.
    args = consumers.hf_objects(exports, str(tmp_path))["args"]
    from transformers import Trainer

    optimizer_class, _ = Trainer.get_optimizer_cls_and_kwargs(args)
    assert f"{optimizer_class.__module__}.{optimizer_class.__name__}".startswith("torchao.optim")
    # Lightning's configure_optimizers and DeepSpeed's client optimizer name it.
    assert f"return {torchao_class}(trainable" in texts["lightning"]
    assert f"optimizer = {torchao_class}(" in texts["deepspeed_notes"]
    assert exports.deepspeed["zero_allow_untested_optimizer"] is True
    # Axolotl accepts it with FSDP2 (it refuses adamw_bnb_8bit there).
    if importlib.util.find_spec("axolotl") is not None:
        found = consumers.axolotl_run(exports, case, str(tmp_path))
        assert found["optimizer"] == "AdamW8bit"
        assert exports.axolotl["optimizer"] == "adamw_torch_8bit"
