"""Exports: each text parses back in its own format to the same values, the Hugging Face key
follows the transformers version, and the generated PyTorch loop really runs and accumulates
exactly the full-batch gradient (also across two DDP ranks)."""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.multiprocessing.spawn import spawn

from autotune.core.exports import build_exports, hf_checkpointing_key, render_exports
from autotune.core.memory.allocator_config import config_from_environ, parse_alloc_conf
from autotune.core.schemas import Exports, Recommendation, TrainingSpec
from tests.autotune_tests.gloo import run_gloo_rank

IGNORE_INDEX = -100
VOCAB = 37
SEQ_LEN = 12


def _rec(b: int, accumulation: int, world: int = 1, checkpointing: bool = False) -> Recommendation:
    return Recommendation(
        micro_batch=b,
        accumulation_steps=accumulation,
        checkpointing=checkpointing,
        world_size=world,
        global_batch=b * accumulation * world,
        samples_per_s=123.0,
        peak_bytes=1000,
        capacity_bytes=2000,
    )


def _exports(rec: Recommendation, *, token_model: bool = True) -> Exports:
    return build_exports(rec, token_model=token_model, transformers_version="5.23.0")


# ---------------------------------------------------------------------------------------------
# Formats and key names.


def _call_kwargs(source: str, callee: str) -> dict[str, Any]:
    """The literal keyword arguments of the first call to `callee` (calls left out)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == callee:
            return {
                kw.arg: ast.literal_eval(kw.value)
                for kw in node.keywords
                if kw.arg and not isinstance(kw.value, ast.Call)
            }
    raise AssertionError(f"no call to {callee} in:\n{source}")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_texts_round_trip_through_their_formats(checkpointing: bool) -> None:
    exports = _exports(_rec(8, 4, world=2, checkpointing=checkpointing))
    texts = render_exports(exports)
    assert yaml.safe_load(texts["axolotl"]) == exports.axolotl
    assert json.loads(texts["deepspeed"]) == exports.deepspeed
    assert _call_kwargs(texts["hf"], "TrainingArguments") == exports.hf
    assert _call_kwargs(texts["lightning"], "L.Trainer") == exports.lightning["trainer"]
    assert _call_kwargs(texts["lightning"], "DDPStrategy") == exports.lightning["ddp_strategy"]
    assert _call_kwargs(texts["lightning"], "YourDataModule") == exports.lightning["datamodule"]
    assert ("ON" in texts["lightning"]) is checkpointing
    for name in ("hf", "lightning", "pytorch_loop"):
        compile(texts[name], f"<{name}>", "exec")
    assert texts["pytorch_loop"] == exports.pytorch_loop
    for name in ("hf", "axolotl", "lightning"):
        assert "global batch 64 = 8 per rank x 4 accumulation steps x 2 rank(s)" in texts[name]


def test_values_use_each_ecosystems_key_names() -> None:
    exports = _exports(_rec(8, 4, world=2, checkpointing=True))
    assert exports.hf == {
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "activation_checkpointing": True,
        "optim": "adamw_torch",
    }
    assert exports.axolotl == {
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "gradient_checkpointing": True,
        "bf16": False,
        "fp16": False,
        "optimizer": "adamw_torch",
    }
    assert exports.deepspeed == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "foreach": True}},
    }
    assert exports.lightning == {
        "trainer": {"accumulate_grad_batches": 4, "precision": "32-true"},
        "datamodule": {"batch_size": 8},
        "module": {
            "gradient_checkpointing": True,
            "optimizer": "torch.optim.AdamW",
            "optimizer_kwargs": {"foreach": True},
        },
        "ddp_strategy": {"gradient_as_bucket_view": True},
    }


def test_one_rank_says_nothing_about_ddp() -> None:
    exports = _exports(_rec(8, 4, world=1))
    texts = render_exports(exports)
    assert "ddp_strategy" not in exports.lightning
    assert "data_parallel" not in texts
    # The loop's template builds DDP only on several ranks, whatever WORLD_SIZE is.
    del texts["pytorch_loop"]
    assert not [name for name, text in texts.items() if "bucket_view" in text]


def test_every_export_says_to_keep_batches_out_of_the_sizes_that_run_out() -> None:
    rec = _rec(18, 2).model_copy(update={"runs_out_below": [10, 13]})
    texts = render_exports(_exports(rec))
    for name, text in texts.items():
        if name in ("data_parallel", "deepspeed"):
            continue  # several ranks only; the JSON's notes are in deepspeed_notes
        assert "micro-batches 10 and 13 run out where 18 fits" in text, name
        assert "keep every batch at" in text and "drop_last=True" in text, name
    compile(texts["hf"], "<hf>", "exec")
    compile(texts["pytorch_loop"], "<loop>", "exec")
    yaml.safe_load(texts["axolotl"])
    # Without dips nothing is said.
    assert not any(
        "run out where" in text for text in render_exports(_exports(_rec(18, 2))).values()
    )


def test_every_export_sets_the_allocator_settings_the_recommendation_holds_for() -> None:
    conf = "expandable_segments:True"
    rec = _rec(18, 2).model_copy(update={"allocator_conf": conf})
    exports = _exports(rec)
    assert exports.allocator_conf == conf
    texts = render_exports(type(exports).model_validate_json(exports.model_dump_json()))
    for name, text in texts.items():
        if name == "deepspeed":
            continue  # JSON: its notes are in deepspeed_notes
        assert f"PYTORCH_ALLOC_CONF={conf}" in text or f'"{conf}"' in text, name
    # The Python texts set it before torch (or anything importing it) is imported.
    for name, first_import in (("hf", "from transformers"), ("lightning", "import lightning")):
        text = texts[name]
        assert f"os.environ['PYTORCH_ALLOC_CONF'] = '{conf}'" in text, name
        assert text.index("os.environ[") < text.index(first_import), name
        compile(text, f"<{name}>", "exec")
    loop = texts["pytorch_loop"]
    compile(loop, "<loop>", "exec")
    assert f'ALLOCATOR_CONF: str | None = "{conf}"' in loop
    # Set first thing in main(), before anything touches CUDA.
    main = loop[loop.index("def main() -> None:") :].splitlines()[1:6]
    assert main[0] == "    if ALLOCATOR_CONF is not None:"
    assert main[4] == '        os.environ["PYTORCH_ALLOC_CONF"] = ALLOCATOR_CONF'
    assert f"PYTORCH_ALLOC_CONF={conf}" in texts["deepspeed_notes"]
    yaml.safe_load(texts["axolotl"])
    # The device's own settings: nothing is said or set.
    plain = render_exports(_exports(_rec(18, 2)))
    assert not any("PYTORCH_ALLOC_CONF" in plain[name] for name in plain if name != "pytorch_loop")
    assert "ALLOCATOR_CONF: str | None = None" in plain["pytorch_loop"]


def test_the_measured_allocator_settings_win_over_a_users_older_variable() -> None:
    """torch reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF: one exported in the
    user's shell would silently replace the measured settings unless each text takes it out."""
    conf = "expandable_segments:True"
    texts = render_exports(_exports(_rec(18, 2).model_copy(update={"allocator_conf": conf})))
    for name in ("hf", "lightning", "pytorch_loop"):
        # The lines run on an environment of their own: set in this process, the measured
        # settings would leak into every later test of this worker.
        environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:40"}
        lines = [line.strip() for line in texts[name].splitlines()]
        namespace = {"os": SimpleNamespace(environ=environ), "ALLOCATOR_CONF": conf}
        exec("\n".join(line for line in lines if line.startswith("os.environ")), namespace)
        assert config_from_environ(environ) == parse_alloc_conf(conf), name
    # The shell line, with a command that reports what a launcher's CUDA would read.
    [shell] = [
        line for line in texts["deepspeed_notes"].splitlines() if "accelerate launch" in line
    ]
    prefix = shell.lstrip("# ").split(" accelerate launch")[0]
    report = (
        "import os; from autotune.core.memory.allocator_config import config_from_environ; "
        "print(config_from_environ(os.environ).expandable_segments)"
    )
    done = subprocess.run(
        f"{prefix} {sys.executable} -c '{report}'",
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:40"},
        check=True,
    )
    assert done.stdout.strip() == "True"


def test_every_export_on_several_ranks_says_how_ddp_was_measured() -> None:
    exports = _exports(_rec(8, 4, world=2))
    texts = render_exports(exports)
    loop = texts["pytorch_loop"]
    assert "DistributedDataParallel(model, gradient_as_bucket_view=True)" in loop
    assert "strategy=DDPStrategy(gradient_as_bucket_view=True)" in texts["lightning"]
    assert "trainer.accelerator.ddp_handler.gradient_as_bucket_view = True" in texts["hf"]
    assert "DistributedDataParallelKwargs(gradient_as_bucket_view=True)" in texts["hf"]
    axolotl_comment = [line for line in texts["axolotl"].splitlines() if line.startswith("#")]
    assert any("one more copy of" in line for line in axolotl_comment)
    assert "DeepSpeed uses no torch DDP" in texts["data_parallel"]
    compile(texts["hf"], "<hf>", "exec")


def test_no_training_arguments_key_sets_gradient_as_bucket_view() -> None:
    """Why the Hugging Face text sets it on the Trainer's accelerator instead."""
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert not [name for name in fields if "bucket_view" in name]


@pytest.mark.parametrize(("b", "accumulation", "world"), [(1, 1, 1), (3, 5, 2), (16, 2, 8)])
def test_deepspeed_batch_invariant(b: int, accumulation: int, world: int) -> None:
    ds = _exports(_rec(b, accumulation, world)).deepspeed
    assert ds["train_batch_size"] == (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    )
    assert ds["train_batch_size"] == b * accumulation * world


def test_rejects_an_inconsistent_recommendation() -> None:
    rec = _rec(4, 2).model_copy(update={"global_batch": 9})
    with pytest.raises(ValueError, match="inconsistent"):
        _exports(rec)


@pytest.mark.parametrize(
    ("version", "key"),
    [
        ("5.23.0", "activation_checkpointing"),
        ("5.0.0rc1", "activation_checkpointing"),
        ("6.1.0", "activation_checkpointing"),
        ("4.57.1", "gradient_checkpointing"),
        ("4.46.0.dev0", "gradient_checkpointing"),
        (None, "gradient_checkpointing"),
    ],
)
def test_hf_checkpointing_key_follows_transformers_version(version: str | None, key: str) -> None:
    assert hf_checkpointing_key(version) == key
    hf = build_exports(_rec(2, 2), token_model=True, transformers_version=version).hf
    assert set(hf) == {"per_device_train_batch_size", "gradient_accumulation_steps", key, "optim"}
    other = ({"activation_checkpointing", "gradient_checkpointing"} - {key}).pop()
    hf_text = render_exports(
        build_exports(_rec(2, 2), token_model=True, transformers_version=version)
    )["hf"]
    assert f"{key}=False" in hf_text
    assert other not in hf_text


def test_rejects_a_garbled_transformers_version() -> None:
    with pytest.raises(ValueError, match="not a transformers version"):
        hf_checkpointing_key("latest")


def test_hf_keys_are_fields_of_the_installed_training_arguments() -> None:
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    exports = build_exports(
        _rec(2, 2), token_model=True, transformers_version=transformers.__version__
    )
    assert set(exports.hf) <= fields


@pytest.mark.parametrize(
    ("token_model", "world", "lora", "sharding"),
    [
        (True, 1, False, "none"),
        (False, 1, False, "none"),
        (True, 4, False, "none"),
        (False, 4, True, "zero1"),
        (True, 1, True, "none"),
        (True, 4, True, "hybrid"),
    ],
)
def test_pytorch_loop_is_lint_clean(
    token_model: bool, world: int, lora: bool, sharding: str
) -> None:
    training = TrainingSpec(
        world_size=world,
        lora=LORA if lora else None,
        sharding=sharding,
        shard_group_size=2 if sharding == "hybrid" else None,
    )
    source = build_exports(
        _rec(4, 2, world=world),
        token_model=token_model,
        transformers_version="5.23.0",
        training=training,
    ).pytorch_loop
    for args in (
        ["check", "--select", "E,W,F,I,B,UP", "--line-length", "99"],
        ["format", "--check", "--line-length", "99"],
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "ruff",
                *args,
                "--isolated",
                "--stdin-filename",
                "loop.py",
                "-",
            ],
            input=source,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_pytorch_loop_states_its_numbers_and_normaliser() -> None:
    token_loop = _exports(_rec(6, 3, world=2)).pytorch_loop
    assert "MICRO_BATCH = 6\n" in token_loop
    assert "ACCUMULATION_STEPS = 3\n" in token_loop
    assert "WORLD_SIZE = 2\n" in token_loop
    assert "label tokens" in token_loop
    assert "dist.all_reduce(num_targets)" in token_loop
    sample_loop = _exports(_rec(6, 3), token_model=False).pytorch_loop
    assert "samples in all of its micro-batches" in sample_loop
    assert "label tokens" not in sample_loop


# ---------------------------------------------------------------------------------------------
# The loop runs. Gradients are compared at the parameters before the update: train_step zeroes
# gradients first and leaves them in place after optimizer.step().


class CausalToyLM(nn.Module):
    """Tiny causal LM: each position sees the running mean of the embeddings up to it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        positions = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        x = x.cumsum(dim=1) / positions
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x)
        return out


class ToyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 5)])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks[1](torch.tanh(self.blocks[0](inputs)))
        return out


def _token_batches(count: int, b: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded micro-batches whose label counts differ a lot (lengths 2..SEQ_LEN)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(count):
        input_ids = torch.randint(VOCAB, (b, SEQ_LEN), generator=generator)
        # Alternate short and long micro-batches so per-micro-batch means are badly unequal.
        high = 4 if index % 2 == 0 else SEQ_LEN + 1
        lengths = torch.randint(2, high, (b, 1), generator=generator)
        labels = input_ids.masked_fill(torch.arange(SEQ_LEN) >= lengths, IGNORE_INDEX)
        batches.append({"input_ids": input_ids, "labels": labels})
    return batches


def _sample_batches(count: int, b: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(b, 8, generator=generator), torch.randint(5, (b,), generator=generator))
        for _ in range(count)
    ]


def _full_batch_token_grads(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    input_ids = torch.cat([mb["input_ids"] for mb in batches])
    labels = torch.cat([mb["labels"] for mb in batches])[:, 1:]
    logits = model(input_ids)[:, :-1]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()  # type: ignore[no-untyped-call]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grads[name.replace("module.", "").replace(".block.", ".")] = param.grad.clone()
    return grads


def _load_loop(source: str, name: str = "autotune_loop") -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": name}
    exec(compile(source, "<pytorch_loop>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("checkpointing", [False, True])
def test_token_loop_accumulates_the_full_batch_gradient(checkpointing: bool) -> None:
    b, accumulation = 3, 4
    loop = _load_loop(_exports(_rec(b, accumulation, checkpointing=checkpointing)).pytorch_loop)
    batches = _token_batches(accumulation, b, seed=1)
    torch.manual_seed(0)
    reference = CausalToyLM()
    model = loop["prepare_model"](copy.deepcopy(reference))
    assert any(type(m).__name__ == "CheckpointedBlock" for m in model.modules()) is checkpointing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    loss = loop["train_step"](model, optimizer, batches)

    assert loss > 0
    assert any(not torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
    _full_batch_token_grads(reference, batches)
    expected = _grads(reference)
    torch.testing.assert_close(_grads(model), expected)

    # The test has power: the old per-micro-batch mean divided by G gives other gradients.
    naive = copy.deepcopy(reference)
    naive.zero_grad()
    for mb in batches:
        logits = naive(mb["input_ids"])[:, :-1]
        mean = F.cross_entropy(
            logits.flatten(0, 1), mb["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
        )
        (mean / accumulation).backward()  # type: ignore[no-untyped-call]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_grads(naive), expected)


LORA = {
    "r": 4,
    "alpha": 8.0,
    "target_modules": ["head", "blocks.1.0"],
    "modules_to_save": ["embed"],
}


def test_lora_is_exported_in_each_ecosystems_keys() -> None:
    exports = build_exports(
        _rec(4, 2),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(lora=LORA),
    )
    config = {
        "r": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "target_modules": ["head", "blocks.1.0"],
        "modules_to_save": ["embed"],
    }
    assert exports.lora == config
    assert {k: exports.axolotl[k] for k in exports.axolotl if "lora" in k or k == "adapter"} == {
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_modules": ["head", "blocks.1.0"],
        "lora_modules_to_save": ["embed"],
    }
    texts = render_exports(exports)
    assert _call_kwargs(texts["hf"], "LoraConfig") == config
    assert "LoraConfig(r=4" in texts["lightning"]
    every_linear = build_exports(
        _rec(4, 2),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(lora={"r": 8}),
    )
    # peft's own "all-linear" in Axolotl (its transformers models name their head); the output
    # head left out everywhere else, as the measurement leaves it out on any model.
    assert every_linear.axolotl["lora_target_modules"] == "all-linear"
    assert every_linear.lora is not None
    assert every_linear.lora["exclude_modules"] == ["lm_head"]
    peft = pytest.importorskip("peft")
    peft.LoraConfig(**config)  # peft takes the keys as they are


def test_lora_loop_accumulates_the_full_batch_gradient() -> None:
    pytest.importorskip("peft")
    b, accumulation = 3, 4
    exports = build_exports(
        _rec(b, accumulation),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(lora=LORA),
    )
    loop = _load_loop(exports.pytorch_loop)
    batches = _token_batches(accumulation, b, seed=2)
    torch.manual_seed(0)
    model = loop["prepare_model"](CausalToyLM())
    reference = copy.deepcopy(model)  # the same adapters, before any step
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))
    optimizer = torch.optim.SGD(trainable, lr=0.1)

    loop["train_step"](model, optimizer, batches)

    _full_batch_token_grads(reference, batches)
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    found = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(grad is not None for grad in expected.values())
    assert any(bool(grad.abs().sum() > 0) for grad in expected.values() if grad is not None)
    torch.testing.assert_close(found, expected)
    # Frozen: no gradient at all.
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_partial_checkpointing_is_exported_as_the_blocks_to_wrap() -> None:
    rec = _rec(3, 4, checkpointing=True).model_copy(
        update={"checkpointed_blocks": 1, "num_blocks": 2}
    )
    exports = build_exports(rec, token_model=True, transformers_version="5.23.0")
    assert exports.checkpointed_blocks == 1
    # The Trainer's flag would checkpoint every layer: off, and the text sets the first one.
    assert exports.hf["activation_checkpointing"] is False
    assert exports.axolotl["gradient_checkpointing"] is True
    texts = render_exports(exports)
    assert "for layer in layers[1:]:" in texts["hf"]
    assert "the first 1 of 2 layers" in texts["hf"]
    assert "self.model.gradient_checkpointing_enable(" in texts["lightning"]
    assert "Axolotl checkpoints every" in texts["axolotl"]

    loop = _load_loop(exports.pytorch_loop)
    assert loop["CHECKPOINT_BLOCKS"] == [0]
    batches = _token_batches(4, 3, seed=1)
    torch.manual_seed(0)
    reference = CausalToyLM()
    model = loop["prepare_model"](copy.deepcopy(reference))
    wrapped = [type(block).__name__ == "CheckpointedBlock" for block in model.blocks]
    assert wrapped == [True, False]
    loop["train_step"](model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    _full_batch_token_grads(reference, batches)
    torch.testing.assert_close(_grads(model), _grads(reference))


def test_sample_loop_accumulates_the_full_batch_gradient() -> None:
    b, accumulation = 4, 3
    loop = _load_loop(_exports(_rec(b, accumulation), token_model=False).pytorch_loop)
    batches = _sample_batches(accumulation, b, seed=2)
    torch.manual_seed(0)
    reference = ToyClassifier()
    model = loop["prepare_model"](copy.deepcopy(reference))
    loop["train_step"](model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    inputs = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    F.cross_entropy(reference(inputs), labels).backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(_grads(model), _grads(reference))


def test_train_groups_loader_batches_into_steps() -> None:
    loop = _load_loop(_exports(_rec(2, 3), token_model=False).pytorch_loop)
    model = loop["prepare_model"](ToyClassifier())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = loop["train"](model, optimizer, _sample_batches(7, 2, seed=3), num_steps=4)
    assert len(losses) == 4
    with pytest.raises(ValueError, match="fewer than 3 batches"):
        loop["train"](model, optimizer, _sample_batches(2, 2, seed=3), num_steps=1)
    with pytest.raises(ValueError, match="expected 3 micro-batches"):
        loop["train_step"](model, optimizer, _sample_batches(2, 2, seed=3))


@pytest.mark.parametrize("token_model", [True, False])
def test_loop_runs_as_a_script(token_model: bool) -> None:
    source = _exports(_rec(4, 2, checkpointing=True), token_model=token_model).pytorch_loop
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _load_loop(source, name="__main__")
    assert "loss per optimizer step" in out.getvalue()


def test_loop_refuses_to_run_on_the_wrong_number_of_ranks() -> None:
    loop = _load_loop(_exports(_rec(2, 2, world=4)).pytorch_loop)
    model = CausalToyLM()
    with pytest.raises(RuntimeError, match="tuned for 4 ranks but running on 1"):
        loop["train_step"](model, torch.optim.SGD(model.parameters()), _token_batches(2, 2, 0))


def _train_my_half(rank: int, source: str, batches: list[dict[str, torch.Tensor]]) -> nn.Module:
    """One optimizer step of the loop on this rank's half of the micro-batches."""
    loop = _load_loop(source)
    torch.manual_seed(0)
    model: nn.Module = loop["prepare_model"](CausalToyLM())
    accumulation = len(batches) // 2
    mine = batches[rank * accumulation : (rank + 1) * accumulation]
    loop["train_step"](model, loop["make_optimizer"](model, lr=0.1), mine)
    return model


def _ddp_rank(
    rank: int, workdir: str, source: str, batches: list[dict[str, torch.Tensor]]
) -> None:
    model = _train_my_half(rank, source, batches)
    # As measured: the gradients are views of DDP's buckets (fewer storages than params).
    assert model.gradient_as_bucket_view
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) < len(list(model.parameters()))
    if rank == 0:
        torch.save(_grads(model), f"{workdir}/grads.pt")


def _fsdp_rank(
    rank: int, workdir: str, source: str, batches: list[dict[str, torch.Tensor]]
) -> None:
    model = _train_my_half(rank, source, batches)
    # As measured: every parameter and gradient is this rank's shard (FSDP2's DTensors).
    assert all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
    grads = {
        name.replace(".block.", "."): p.grad.full_tensor()  # a collective: on both ranks
        for name, p in model.named_parameters()
    }
    if rank == 0:
        torch.save(grads, f"{workdir}/grads.pt")


@pytest.mark.e2e
@pytest.mark.slow
def test_sharded_loop_on_two_gloo_ranks_matches_the_full_batch(tmp_path: Path) -> None:
    """The ZeRO-3 loop: FSDP2 on every block and the root, the gradients reduce-scattered after
    every micro-batch and accumulated sharded, still the full batch's."""
    b, accumulation = 2, 2
    source = build_exports(
        _rec(b, accumulation, world=2, checkpointing=True),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(world_size=2, sharding="zero3"),
    ).pytorch_loop
    batches = _token_batches(2 * accumulation, b, seed=5)
    batches.sort(key=lambda mb: int((mb["labels"] != IGNORE_INDEX).sum()))
    spawn(run_gloo_rank, args=(_fsdp_rank, str(tmp_path), source, batches), nprocs=2, join=True)  # type: ignore[no-untyped-call]

    torch.manual_seed(0)
    reference = CausalToyLM()
    _full_batch_token_grads(reference, batches)
    torch.testing.assert_close(torch.load(tmp_path / "grads.pt"), _grads(reference))


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3", "hybrid"])
def test_sharding_is_exported_in_each_ecosystems_keys(sharding: str) -> None:
    training = TrainingSpec(
        world_size=8, sharding=sharding, shard_group_size=4 if sharding == "hybrid" else None
    )
    exports = build_exports(
        _rec(2, 2, world=8), token_model=True, transformers_version="5.23.0", training=training
    )
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "hybrid": 3}[sharding]
    assert exports.deepspeed["zero_optimization"] == {"stage": stage}
    texts = render_exports(exports)
    assert f"ZeRO stage {stage}" in texts["data_parallel"]
    assert "gradient_as_bucket_view" not in texts["hf"] + texts["axolotl"]
    if sharding == "zero1":
        assert exports.hf["deepspeed"] == exports.deepspeed
        assert exports.axolotl["deepspeed"] == exports.deepspeed
        # Measured as DDP with torch's ZeroRedundancyOptimizer: so in Lightning.
        assert exports.lightning["ddp_strategy"] == {"gradient_as_bucket_view": True}
        assert "ZeroRedundancyOptimizer(trainable" in texts["lightning"]
        return
    reshard = sharding != "zero2"
    assert exports.hf["fsdp"] is True
    assert exports.hf["fsdp_config"] == {"version": 2, "reshard_after_forward": reshard}
    assert exports.axolotl["fsdp_version"] == 2
    assert exports.axolotl["fsdp_config"]["reshard_after_forward"] is reshard
    assert exports.lightning["model_parallel_strategy"] == {
        "data_parallel_size": 8,
        "tensor_parallel_size": 1,
    }
    assert f"reshard_after_forward={reshard})" in texts["lightning"]
    if sharding == "hybrid":
        groups = {"dp_replicate_size": 2, "dp_shard_size": 4}
        assert exports.hf["parallelism_config"] == groups
        assert {k: exports.axolotl[k] for k in groups} == groups
        assert '(2, 4), mesh_dim_names=("replicate", "shard")' in texts["lightning"]
        assert "Hybrid sharding (groups of 4) cannot be expressed" in texts["deepspeed_notes"]
    # Before transformers 5: FSDP1's string, and the text says so.
    old = build_exports(
        _rec(2, 2, world=8), token_model=True, transformers_version="4.57.0", training=training
    )
    strategy = {"zero2": "shard_grad_op", "zero3": "full_shard", "hybrid": "hybrid_shard"}
    assert old.hf["fsdp"] == f"{strategy[sharding]} auto_wrap"
    assert "FSDP1 (the fsdp string)" in render_exports(old)["hf"]
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(exports.hf) <= fields


@pytest.mark.e2e
def test_token_loop_on_two_ddp_ranks_matches_the_full_batch(tmp_path: Path) -> None:
    """Rank 0 gets short sequences, rank 1 long ones: DDP's plain mean over ranks would
    over-weight rank 0's tokens; the all-reduced token count must not."""
    b, accumulation = 2, 2
    source = _exports(_rec(b, accumulation, world=2, checkpointing=True)).pytorch_loop
    batches = _token_batches(2 * accumulation, b, seed=4)
    batches.sort(key=lambda mb: int((mb["labels"] != IGNORE_INDEX).sum()))
    spawn(run_gloo_rank, args=(_ddp_rank, str(tmp_path), source, batches), nprocs=2, join=True)  # type: ignore[no-untyped-call]

    torch.manual_seed(0)
    reference = CausalToyLM()
    _full_batch_token_grads(reference, batches)
    torch.testing.assert_close(torch.load(tmp_path / "grads.pt"), _grads(reference))


@pytest.mark.parametrize(("b", "accumulation", "world"), [(4, 8, 1), (2, 4, 4), (16, 1, 2)])
def test_a_token_target_round_trips_into_every_export(
    b: int, accumulation: int, world: int
) -> None:
    seq_len = 128
    tokens = b * accumulation * world * seq_len
    training = TrainingSpec(seq_len=seq_len, target_global_tokens=tokens, world_size=world)
    assert training.target_global_batch == tokens // seq_len
    exports = build_exports(
        _rec(b, accumulation, world),
        token_model=True,
        transformers_version="5.23.0",
        training=training,
    )
    axolotl = exports.axolotl
    assert axolotl["sample_packing"] is True
    per_step = axolotl["micro_batch_size"] * axolotl["gradient_accumulation_steps"] * world
    assert per_step * axolotl["sequence_len"] == tokens
    assert exports.deepspeed["train_batch_size"] * seq_len == tokens
    texts = render_exports(exports)
    # The notes every text carries (autotune.core.exports.notes), the DeepSpeed JSON's in its
    # notes text.
    for name in ("hf", "axolotl", "lightning", "pytorch_loop", "deepspeed_notes"):
        assert f"{tokens} tokens per optimizer step" in texts[name], name
    assert f"max_length={seq_len}" in texts["hf"]
    assert yaml.safe_load(texts["axolotl"]) == axolotl
    # A target in samples says nothing about tokens.
    plain = build_exports(
        _rec(b, accumulation, world),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(seq_len=seq_len, target_global_batch=tokens // seq_len),
    )
    assert plain.tokens_per_sample is None and "sequence_len" not in plain.axolotl
    assert not any("tokens per optimizer step" in text for text in render_exports(plain).values())


def test_weights_precision_and_the_8bit_optimizer_are_exported_as_measured() -> None:
    training = TrainingSpec(precision="bf16", weights="bf16", optimizer="adamw8bit")
    exports = build_exports(
        _rec(8, 4), token_model=True, transformers_version="5.23.0", training=training
    )
    # The class itself (optim="adamw_bnb_8bit" keeps embedding states in 32 bits).
    assert exports.hf["bf16"] is True and "optim" not in exports.hf
    assert exports.axolotl["bf16"] is True and exports.axolotl["optimizer"] == "adamw_bnb_8bit"
    # bf16-mixed on weights the module loads in bf16: autocast as measured, and bf16-true's
    # cast of fp32 LoRA adapters avoided.
    assert exports.lightning["trainer"]["precision"] == "bf16-mixed"
    assert exports.lightning["module"]["weights_dtype"] == "bfloat16"
    assert exports.deepspeed["bf16"] == {"enabled": True}
    assert "optimizer" not in exports.deepspeed  # a client optimizer
    texts = render_exports(exports)
    assert "dtype=torch.bfloat16" in texts["hf"]
    assert "optimizer_cls_and_kwargs = (bitsandbytes.optim.AdamW8bit, {})" in texts["hf"]
    assert "bitsandbytes.optim.AdamW8bit(trainable" in texts["lightning"]
    assert "bitsandbytes.optim.AdamW8bit" in texts["pytorch_loop"]
    assert 'OPTIMIZER = "adamw8bit"' in texts["pytorch_loop"]
    assert 'WEIGHTS_DTYPE = "bfloat16"' in texts["pytorch_loop"]
    assert "client optimizer" in texts["deepspeed_notes"]
    assert "an fp32 master copy" in texts["deepspeed_notes"]
    # fp32 master weights under bf16 autocast: mixed precision, and no bf16 load but in Axolotl,
    # which cannot express it and says so.
    mixed = build_exports(
        _rec(8, 4),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(precision="bf16"),
    )
    assert mixed.hf["bf16"] is True and mixed.hf["optim"] == "adamw_torch"
    assert mixed.lightning["trainer"]["precision"] == "bf16-mixed"
    assert mixed.deepspeed["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "bf16" not in mixed.deepspeed
    assert "dtype=torch.bfloat16" not in render_exports(mixed)["hf"]
    assert "Axolotl cannot express" in render_exports(mixed)["axolotl"]


@pytest.mark.parametrize("tf32", [True, False])
def test_a_spec_s_tf32_setting_is_exported_as_measured(tf32: bool) -> None:
    exports = build_exports(
        _rec(8, 4),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(tf32=tf32),
    )
    assert exports.hf["tf32"] is tf32 and exports.axolotl["tf32"] is tf32
    precision = "high" if tf32 else "highest"
    assert (
        f"torch.set_float32_matmul_precision('{precision}')"
        in render_exports(exports)["lightning"]
    )
    # Left unset, torch's defaults apply and no export mentions TF32.
    plain = _exports(_rec(8, 4))
    assert "tf32" not in plain.hf and "tf32" not in plain.axolotl
    assert "float32_matmul_precision" not in render_exports(plain)["lightning"]


def test_the_training_step_sets_tf32_as_the_spec_says() -> None:
    from autotune.core.schemas import TrainingSpec
    from autotune.engine.training.step import TrainingStep
    from tests.autotune_tests.factories import tiny_lm

    before = (
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,  # type: ignore[attr-defined]
    )
    try:
        for tf32, precision in ((True, "tf32"), (False, "ieee")):
            training = TrainingSpec(seq_len=8, tf32=tf32)
            TrainingStep(tiny_lm(training), training, torch.device("cpu"))
            assert torch.backends.cuda.matmul.fp32_precision == precision
            assert torch.backends.cudnn.conv.fp32_precision == precision  # type: ignore[attr-defined]
    finally:
        torch.backends.cuda.matmul.fp32_precision = before[0]
        torch.backends.cudnn.conv.fp32_precision = before[1]  # type: ignore[attr-defined]


def test_a_loop_for_your_models_lora_modules_still_runs_its_demo() -> None:
    """The measured LoRA targets are the user's model's names ([q_proj, v_proj]), which the demo
    model lacks: the demo adapts its own linear layers, and prepare_model keeps LORA for yours."""
    pytest.importorskip("peft")
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}
    source = build_exports(
        _rec(2, 2),
        token_model=True,
        transformers_version="5.23.0",
        training=TrainingSpec(lora=lora),
    ).pytorch_loop
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        loop = _load_loop(source, name="__main__")
    assert "adapting its linear layers instead" in out.getvalue()
    assert "loss per optimizer step" in out.getvalue()
    assert loop["LORA"]["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_loops_demo_runs_in_every_precision_and_optimizer(precision: str) -> None:
    """fp32, bf16 and fp16 loops once printed identical losses: now each autocasts (fp16 with a
    GradScaler) and builds the measured optimizer."""
    for optimizer in ("sgd", "adafactor", "adamw8bit"):
        pytest.importorskip("bitsandbytes")
        source = build_exports(
            _rec(2, 2),
            token_model=True,
            transformers_version="5.23.0",
            training=TrainingSpec(precision=precision, optimizer=optimizer),
        ).pytorch_loop
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            loop = _load_loop(source, name="__main__")
        assert "loss per optimizer step" in out.getvalue()
        model = loop["DemoModel"]()
        built = loop["make_optimizer"](model, lr=1e-3)
        assert (
            type(built).__name__
            == {
                "sgd": "SGD",
                "adafactor": "Adafactor",
                "adamw8bit": "AdamW8bit",
            }[optimizer]
        )
        assert (loop["make_scaler"](model) is not None) is (precision == "fp16")


@pytest.mark.e2e
def test_the_zero1_loop_leaves_eight_gloo_ranks_cleanly(tmp_path: Path) -> None:
    """The ZeRO-1 loop under torchrun on 8 gloo ranks once aborted at exit about one run in two
    ("terminate called without an active exception"); since its ranks leave the group together
    (leave_process_group) 8 of 8 runs exited 0. torchrun's --standalone rendezvous takes a free
    port; `--master-port 0` hands the ranks port 0 on torch 2.13 and they wait forever."""
    training = TrainingSpec(world_size=8, sharding="zero1")
    source = build_exports(
        _rec(2, 2, world=8), token_model=True, transformers_version=None, training=training
    ).pytorch_loop
    (tmp_path / "loop.py").write_text(source)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "8", "loop.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("loss per optimizer step") == 8
    assert "terminate called" not in result.stderr


@pytest.mark.parametrize("conf", [None, "max_split_size_mb:40,expandable_segments:True"])
def test_axolotl_is_launched_with_the_settings_measured_not_its_own(conf: str | None) -> None:
    """Axolotl's CLI sets expandable segments as it starts (`set_pytorch_cuda_alloc_conf`: in
    PYTORCH_ALLOC_CONF when that is unset, else in PYTORCH_CUDA_ALLOC_CONF, which torch reads
    first), and they can fit less (docs/design.md#expandable-segments-as-a-knob): the line the
    text gives launches it with the settings measured, torch's defaults or the run's own, which
    Axolotl's function then leaves, whatever the user's shell held."""
    rec = _rec(18, 2).model_copy(update={"allocator_conf": conf})
    text = render_exports(_exports(rec))["axolotl"]
    [shell] = [line for line in text.splitlines() if "axolotl train" in line]
    prefix = shell.lstrip("# ").split(" axolotl train")[0]
    report = (
        "import os; from axolotl.utils import set_pytorch_cuda_alloc_conf; "
        "from autotune.core.memory import allocator_config as a; set_pytorch_cuda_alloc_conf(); "
        "print(a.canonical_conf(a.config_from_environ(os.environ)))"
    )
    shell_environment = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:60"}
    done = subprocess.run(
        f"{prefix} {sys.executable} -c '{report}'",
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, **shell_environment, "PYTORCH_ALLOC_CONF": "max_split_size_mb:80"},
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == str(conf)
