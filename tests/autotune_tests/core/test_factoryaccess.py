"""The workers' factory allow-list: prefixes on dotted module boundaries, refusals that import
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.core.errors import FactoryRefused
from autotune.core.factoryaccess import check_factory_allowed, is_factory_allowed, parse_prefix
from autotune.core.schemas import ModelSpec, Spec, TrainingSpec
from autotune.engine.training.workload import build_workload


@pytest.mark.parametrize(
    ("factory", "prefixes", "allowed"),
    [
        ("tests:make", ["tests"], True),
        ("tests.x:make", ["tests"], True),
        ("tests.x.y:make", ["tests"], True),
        ("testsuite:make", ["tests"], False),
        ("testsuite.x:make", ["tests"], False),
        ("tests:make", ["tests.x"], False),
        ("tests.xy:make", ["tests.x"], False),
        ("tests.x.y:make", ["tests.x"], True),
        ("builtins:print", ["tests"], False),
        ("builtins:print", [], False),
        ("os:system", ["o"], False),
        ("mypkg.models:make", ["other", "mypkg"], True),
    ],
)
def test_prefixes_match_on_dotted_module_boundaries(
    factory: str, prefixes: list[str], allowed: bool
) -> None:
    assert is_factory_allowed(factory, prefixes) is allowed


def test_a_refusal_says_how_to_allow_the_factory() -> None:
    with pytest.raises(FactoryRefused) as raised:
        check_factory_allowed("builtins:print", [])
    assert str(raised.value) == (
        "factory 'builtins:print' refused: this worker allows no factories; to run it, start a "
        "worker with --allow-factory builtins (or a narrower prefix of 'builtins')"
    )
    with pytest.raises(FactoryRefused, match="allows factories only under tests, mypkg;"):
        check_factory_allowed("mypkgx.m:f", ["tests", "mypkg"])


@pytest.mark.parametrize("text", ["", ".", "a.", ".a", "a..b", "a-b", "a/b", "1a", "a:b"])
def test_prefixes_must_be_dotted_module_names(text: str) -> None:
    with pytest.raises(ValueError, match="not a dotted module name"):
        parse_prefix(text)


def test_a_refused_factory_is_never_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "factory_with_side_effect.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef make(training): raise AssertionError\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    spec = Spec(
        model=ModelSpec(factory="factory_with_side_effect:make"),
        training=TrainingSpec(input_shape=(4,)),
    )
    for prefixes in ([], ["factory_with"], ["tests"]):
        with pytest.raises(FactoryRefused):
            build_workload(spec, allowed_factory_prefixes=prefixes)
    assert "factory_with_side_effect" not in sys.modules
    assert not marker.exists()
