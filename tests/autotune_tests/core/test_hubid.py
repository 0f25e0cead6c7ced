"""The hub-id grammar `hf_id` follows, and the spec field that uses it."""

from __future__ import annotations

import pytest

from autotune.core.errors import SpecError
from autotune.core.hubid import HUB_ID_PART_MAX, hub_id_problem, is_hub_id
from autotune.core.specfile import parse_spec


@pytest.mark.parametrize(
    "hub_id",
    [
        "gpt2",
        "openai-community/gpt2",
        "meta-llama/Llama-3.2-1B",
        "Foo-BAR_foo.bar123",
        "_private/x",
        "123",
        "a" * HUB_ID_PART_MAX,
        f"{'o' * HUB_ID_PART_MAX}/{'n' * HUB_ID_PART_MAX}",
    ],
)
def test_hub_ids_are_accepted(hub_id: str) -> None:
    assert is_hub_id(hub_id)
    assert parse_spec({"model": {"hf_id": hub_id}, "training": {"seq_len": 8}})


@pytest.mark.parametrize(
    "text",
    [
        ".",
        "..",
        "../x",
        "a/..",
        "./config",
        "/etc",
        "a/b/c",
        "a//b",
        "/",
        "x..y",
        "x--y",
        "-x",
        "x-",
        ".x",
        "x.",
        "org/.hidden",
        "repo.git",
        "café",
        "a b",
        "a\\b",
        "~/models",
        "a" * (HUB_ID_PART_MAX + 1),
        "C:model",
    ],
)
def test_paths_and_other_non_ids_are_refused_by_the_spec(text: str) -> None:
    assert not is_hub_id(text)
    with pytest.raises(SpecError, match=r"hf_id: not a Hugging Face hub id: ") as raised:
        parse_spec({"model": {"hf_id": text}, "training": {"seq_len": 8}})
    if len(text) > 3:  # the reason never quotes the text (it may come from anyone)
        assert text not in str(raised.value)


def test_each_refusal_says_why() -> None:
    assert hub_id_problem("a/b/c") == "expected 'name' or 'namespace/name'"
    assert hub_id_problem("x..y") == "'--' and '..' are not allowed"
    assert hub_id_problem("x.git") == "an id cannot end in '.git'"
    assert hub_id_problem("a" * 97) == "a namespace or name is longer than 96 characters"
