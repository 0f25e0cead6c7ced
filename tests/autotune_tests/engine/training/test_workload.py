"""Workloads from each model source: preset, hf_config, hf_id and factory."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.core.errors import ModelBuildError, SpecError
from autotune.core.schemas import ModelSpec, Spec, TrainingSpec
from autotune.engine.training.step import TrainingStep
from autotune.engine.training.workload import Workload, build_preset, build_workload
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

CPU = torch.device("cpu")
TINY_GPT2_CONFIG: dict[str, Any] = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 256,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def _spec(training: TrainingSpec | None = None, **model: Any) -> Spec:
    return Spec(model=ModelSpec(**model), training=training or TrainingSpec())


def _loss_per_item(workload: Workload, micro_batch: int = 2) -> float:
    batch = workload.make_batch(micro_batch, CPU)
    return workload.loss_sum(workload.model, batch).item() / workload.num_items(batch)


# ---------------------------------------------------------------------------------------------
# Presets.


def test_preset_token_batches_are_int64_ids_and_the_loss_is_a_sum() -> None:
    workload = build_workload(_spec(TrainingSpec(seq_len=32), preset="gpt2-tiny"))
    batch = workload.make_batch(3, CPU)
    assert batch["input_ids"].shape == (3, 32) and batch["input_ids"].dtype == torch.int64
    assert workload.num_items(batch) == 3 * 31  # next-token labels: all but the first
    assert workload.tokens_per_sample == 32
    # A sum over 93 tokens of about ln(8192) each, not a mean.
    assert _loss_per_item(workload, 3) == pytest.approx(math.log(8192), rel=0.1)


def test_preset_seq_len_defaults_to_max_and_is_capped() -> None:
    assert build_preset("gpt2-tiny").tokens_per_sample == 256
    with pytest.raises(SpecError, match=r"training\.seq_len: 257 exceeds the max_seq_len 256"):
        build_preset("gpt2-tiny", seq_len=257)


def test_preset_classifiers_take_input_shape() -> None:
    cnn = build_preset("cnn", input_shape=(1, 12, 12))
    batch = cnn.make_batch(5, CPU)
    assert batch["inputs"].shape == (5, 1, 12, 12)
    assert cnn.num_items(batch) == 5 and cnn.tokens_per_sample is None
    assert _loss_per_item(cnn) == pytest.approx(math.log(10), rel=0.3)
    mlp = build_workload(_spec(TrainingSpec(input_shape=(2, 14, 14)), preset="mlp"))
    assert mlp.make_batch(2, CPU)["inputs"].shape == (2, 2, 14, 14)
    with pytest.raises(SpecError, match=r"training\.input_shape"):
        build_preset("cnn", input_shape=(32, 32))


# ---------------------------------------------------------------------------------------------
# hf_config.


@pytest.mark.parametrize("config", [TINY_LLAMA_CONFIG, TINY_GPT2_CONFIG], ids=["llama", "gpt2"])
def test_hf_config_builds_a_random_fp32_model_that_trains(config: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    training = TrainingSpec(seq_len=16)
    workload = build_workload(_spec(training, hf_config=config))
    assert workload.tokens_per_sample == 16
    assert (
        type(workload.model).__name__.endswith("ForCausalLM")
        or "LMHead" in type(workload.model).__name__
    )
    assert all(p.dtype == torch.float32 for p in workload.model.parameters())
    assert _loss_per_item(workload) == pytest.approx(math.log(256), rel=0.1)
    step = TrainingStep(workload, training, CPU)
    plain = step.run(2)
    step.checkpointing = True
    flags = [getattr(m, "gradient_checkpointing", False) for m in step.model.modules()]
    assert any(flag is True for flag in flags)
    assert math.isfinite(step.run(2))
    step.checkpointing = False
    flags = [getattr(m, "gradient_checkpointing", False) for m in step.model.modules()]
    assert not any(flag is True for flag in flags)
    assert math.isfinite(plain)


def test_hf_config_loss_sum_matches_transformers_own_loss() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    workload = build_workload(_spec(TrainingSpec(seq_len=16), hf_config=TINY_LLAMA_CONFIG))
    batch = workload.make_batch(3, CPU)
    labels = batch["labels"].clone()
    labels[0, 10:] = -100  # padding on one row
    batch = {"input_ids": batch["input_ids"], "labels": labels}
    ours = workload.loss_sum(workload.model, batch)
    theirs = workload.model(input_ids=batch["input_ids"], labels=labels).loss  # a token mean
    assert workload.num_items(batch) == 3 * 15 - 6
    torch.testing.assert_close(ours, theirs * workload.num_items(batch))


def test_hf_config_keeps_its_dropout() -> None:
    # The emulated GPU counts dropout as a GPU does (fused attention keeps no mask, other
    # dropouts keep theirs: autotune/engine/emulation/attention.py), so the config is trained as
    # written.
    pytest.importorskip("transformers")
    config = {**TINY_GPT2_CONFIG, "attn_pdrop": 0.1, "resid_pdrop": 0.2}
    workload = build_workload(_spec(TrainingSpec(seq_len=8), hf_config=config))
    hf_config = workload.model.config  # type: ignore[union-attr]
    assert hf_config.attn_pdrop == 0.1 and hf_config.resid_pdrop == 0.2


def test_hf_config_ignores_the_configs_dtype() -> None:
    pytest.importorskip("transformers")
    config = {**TINY_LLAMA_CONFIG, "dtype": "bfloat16"}
    workload = build_workload(_spec(TrainingSpec(seq_len=8), hf_config=config))
    assert {p.dtype for p in workload.model.parameters()} == {torch.float32}


def test_hf_config_errors_name_the_field() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match=r"training\.seq_len: 65 exceeds max_position_embeddings"):
        build_workload(_spec(TrainingSpec(seq_len=65), hf_config=TINY_LLAMA_CONFIG))
    with pytest.raises(ModelBuildError, match="hf_config"):
        build_workload(_spec(TrainingSpec(seq_len=8), hf_config={"model_type": "no-such-model"}))


def test_hf_sources_without_transformers_ask_for_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ModelBuildError, match=r"install the `hf` extra"):
        build_workload(_spec(TrainingSpec(seq_len=8), hf_config=TINY_LLAMA_CONFIG))


def test_hf_id_fails_fast_without_the_hub() -> None:
    pytest.importorskip("transformers")
    hf_id = "autotune-tests/no-such-model-in-any-cache"
    started = time.monotonic()
    with pytest.raises(ModelBuildError) as caught:
        build_workload(_spec(TrainingSpec(seq_len=8), hf_id=hf_id))
    elapsed_s = time.monotonic() - started
    message = str(caught.value)
    assert message.startswith(
        f"hf_id: could not fetch config for '{hf_id}' from the Hugging Face hub ("
    )
    assert message.endswith("); pass hf_config instead")
    assert elapsed_s < 30


def _cache_hub_config(cache: Path, hf_id: str, text: str) -> None:
    """Put `text` in huggingface_hub's cache layout as hf_id's config.json at revision main."""
    repo = cache / f"models--{hf_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(text)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline: only what a test caches can be found."""
    constants = pytest.importorskip("huggingface_hub.constants")
    pytest.importorskip("transformers")
    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hf_id_builds_from_the_hub_cache_and_never_runs_remote_code(hub_cache: Path) -> None:
    config = {**TINY_LLAMA_CONFIG, "auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}
    _cache_hub_config(hub_cache, "org/tiny-llama", json.dumps(config))
    workload = build_workload(_spec(TrainingSpec(seq_len=8), hf_id="org/tiny-llama"))
    assert type(workload.model).__name__ == "LlamaForCausalLM"
    assert "evil" not in sys.modules


def test_hf_id_is_never_read_from_a_local_directory(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory named like the id, next to where the worker runs, holds a valid config:
    # transformers' from_pretrained would read it; a hub id must not.
    (tmp_path / "work" / "models").mkdir(parents=True)
    (tmp_path / "work" / "models" / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ModelBuildError, match=r"hf_id: could not fetch config for 'models'"):
        build_workload(_spec(TrainingSpec(seq_len=8), hf_id="models"))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("SECRET=hunter2 not json", r"is not a readable JSON file \(JSONDecodeError\)"),
        ('{"secret": "hunter2"}', 'has no "model_type" string'),
        ('{"model_type": "hunter2"}', r"transformers rejected its config\.json .*: ValueError"),
        (
            json.dumps({**TINY_LLAMA_CONFIG, "vocab_size": "hunter2"}),
            r"(transformers rejected its config\.json|could not build a causal LM)",
        ),
    ],
)
def test_a_bad_hub_config_is_named_by_path_and_kind_never_quoted(
    hub_cache: Path, text: str, problem: str
) -> None:
    _cache_hub_config(hub_cache, "org/broken", text)
    with pytest.raises(ModelBuildError, match=problem) as raised:
        build_workload(_spec(TrainingSpec(seq_len=8), hf_id="org/broken"))
    assert str(raised.value).startswith("hf_id 'org/broken': ")
    assert "config.json" in str(raised.value)
    assert "hunter2" not in str(raised.value)


def test_no_source_ever_sets_trust_remote_code() -> None:
    root = Path(__file__).resolve().parents[3]
    offenders = [
        str(path.relative_to(root))
        for package in ("autotune", "api", "probes")
        for path in sorted((root / package).rglob("*.py"))
        if "trust_remote_code" in path.read_text()
    ]
    assert offenders == []


# ---------------------------------------------------------------------------------------------
# factory.

FACTORIES = "tests.autotune_tests.factories"


def test_factory_workload_is_built_from_the_training_spec() -> None:
    training = TrainingSpec(seq_len=12)
    workload = build_workload(_spec(training, factory=f"{FACTORIES}:tiny_lm"))
    assert workload.tokens_per_sample == 12
    assert workload.make_batch(2, CPU)["input_ids"].shape == (2, 12)
    assert math.isfinite(TrainingStep(workload, training, CPU).run(2, 2))


def test_factory_code_is_imported_only_when_the_workload_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_factory_module.py").write_text(
        "from tests.autotune_tests.factories import tiny_lm as build\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "user_factory_module", raising=False)
    spec = _spec(TrainingSpec(seq_len=4), factory="user_factory_module:build")
    assert "user_factory_module" not in sys.modules
    assert build_workload(spec).tokens_per_sample == 4
    assert "user_factory_module" in sys.modules
    monkeypatch.delitem(sys.modules, "user_factory_module")


def test_factory_missing_module_is_a_model_build_error() -> None:
    with pytest.raises(ModelBuildError, match=r"No module named 'tests\.autotune_tests\.nope'"):
        build_workload(_spec(factory="tests.autotune_tests.nope:build"))


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (
            f"{FACTORIES}:no_such_function",
            rf"factory '{FACTORIES}:no_such_function': AttributeError: .*no_such_function",
        ),
        (
            f"{FACTORIES}:returns_a_module",
            rf"factory '{FACTORIES}:returns_a_module' must return an "
            r"autotune\.engine\.training\.workload\.Workload.*got Linear",
        ),
        (
            f"{FACTORIES}:raises_inside",
            rf"factory '{FACTORIES}:raises_inside' raised RuntimeError: the user's factory broke",
        ),
    ],
)
def test_factory_errors_are_model_build_errors_naming_the_factory(
    factory: str, message: str
) -> None:
    with pytest.raises(ModelBuildError, match=message):
        build_workload(_spec(TrainingSpec(input_shape=(8,)), factory=factory))


def test_factory_shapes_must_match_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        SpecError, match=r"^training\.input_shape: factory .* builds a token model"
    ):
        build_workload(_spec(TrainingSpec(input_shape=(8,)), factory=f"{FACTORIES}:tiny_lm"))
    classifier = f"{FACTORIES}:tiny_classifier_without_checkpointing"
    with pytest.raises(SpecError, match=r"^training\.seq_len: .* tokens_per_sample=None"):
        build_workload(_spec(TrainingSpec(seq_len=8), factory=classifier))
    (tmp_path / "fixed_length_factory.py").write_text(
        "from autotune.core.schemas import TrainingSpec\n"
        "from tests.autotune_tests.factories import tiny_lm\n"
        "def make(training):\n"
        "    return tiny_lm(TrainingSpec(seq_len=16))  # ignores the spec's seq_len\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(SpecError, match=r"^training\.seq_len: 8, but .* samples of 16 tokens"):
        build_workload(_spec(TrainingSpec(seq_len=8), factory="fixed_length_factory:make"))
    monkeypatch.delitem(sys.modules, "fixed_length_factory")


def test_a_factory_module_that_is_not_on_the_path_gets_a_hint() -> None:
    with pytest.raises(ModelBuildError) as raised:
        build_workload(_spec(factory="my_factory_next_to_the_spec:make"))
    message = str(raised.value)
    assert message.startswith(
        "factory 'my_factory_next_to_the_spec:make': No module named "
        "'my_factory_next_to_the_spec' on this process's path"
    )
    assert "PYTHONPATH" in message and "next to the spec file" in message


def test_a_missing_dependency_of_the_factory_module_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "factory_with_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ModelBuildError) as raised:
        build_workload(_spec(factory="factory_with_missing_dep:make"))
    assert str(raised.value) == (
        "factory 'factory_with_missing_dep:make': importing 'factory_with_missing_dep' failed: "
        "No module named 'no_such_dependency_xyz'"
    )
