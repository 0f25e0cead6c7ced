"""Axolotl's keys come from one table, read from one release's schema: every key an export
writes is in it, and each is a field of that release's config schema where it is installed."""

from __future__ import annotations

import importlib.metadata

import pytest

from autotune.core.exports import build_exports
from autotune.core.exports.axolotl import AXOLOTL_KEYS, AXOLOTL_VERSION
from tests.autotune_tests.core.exports.roundtrip import CASES


@pytest.mark.parametrize("name", list(CASES))
def test_every_key_an_export_writes_is_in_the_table(name: str) -> None:
    case = CASES[name]
    exports = build_exports(
        case.recommendation(), token_model=True, transformers_version=None, training=case.spec()
    )
    assert set(exports.axolotl) <= set(AXOLOTL_KEYS.values())


def test_the_table_is_the_installed_schemas() -> None:
    pytest.importorskip("axolotl", reason="make env installs Axolotl's schema (no-deps)")
    from axolotl.utils.schemas.config import AxolotlInputConfig

    assert importlib.metadata.version("axolotl") == AXOLOTL_VERSION
    assert set(AXOLOTL_KEYS.values()) <= set(AxolotlInputConfig.model_fields)
