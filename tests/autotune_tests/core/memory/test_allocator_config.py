"""`PYTORCH_ALLOC_CONF` parsing (docs/design.md#the-caching-allocator-model): c10's
`AllocatorConfig_test` re-stated (its numbers, our parser), clear errors, the environment
variables' precedence, and a differential test against the parser of the installed torch
2.13.0 binary (`torch._C._accelerator_setAllocatorSettings`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autotune.core.memory.allocator_config import (
    MIB,
    AllocatorConfig,
    AllocatorConfigError,
    canonical_conf,
    config_from_environ,
    parse_alloc_conf,
    settings_text,
)


def divisions(config: AllocatorConfig, *sizes_mib: int) -> list[int]:
    return [config.divisions_for(size * MIB) for size in sizes_mib]


def test_c10_allocator_config_test() -> None:
    """c10/test/core/AllocatorConfig_test.cpp, `allocator_config_test` (without its test-only
    `device_specific_option_mb` key, which only its own parser hook knows)."""
    config = parse_alloc_conf(
        "max_split_size_mb:40,"
        "max_non_split_rounding_mb:30,"
        "garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],"
        "expandable_segments:True,"
        "pinned_use_background_threads:True"
    )
    assert config.large_segment_bytes == 20 * MIB
    assert config.max_split_bytes == 40 * MIB
    assert config.max_non_split_rounding_bytes == 30 * MIB
    assert config.garbage_collection_threshold == 0.5
    sizes = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert divisions(config, *sizes) == [8, 8, 2, 4, 2, 4, 1, 1, 1]
    assert config.expandable_segments

    config = parse_alloc_conf(
        "large_segment_size_mb:15,"
        "max_split_size_mb:20,"
        "max_non_split_rounding_mb:40,"
        "garbage_collection_threshold:0.8"
    )
    assert config.large_segment_bytes == 15 * MIB
    assert config.max_split_bytes == 20 * MIB
    assert config.max_non_split_rounding_bytes == 40 * MIB
    assert config.garbage_collection_threshold == 0.8

    config = parse_alloc_conf("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    assert divisions(config, 64, 128, 256, 512, 1024, 2048, 4096) == [8, 8, 16, 1, 0, 8, 2]

    config = parse_alloc_conf("roundup_power2_divisions:4")  # the single-value syntax
    assert divisions(config, 64, 256, 2048) == [4, 4, 4]

    assert not parse_alloc_conf("expandable_segments:False,").expandable_segments

    # max_split_size_mb must be >= large_segment_size_mb, wherever that comes in the string.
    with pytest.raises(AllocatorConfigError, match="must be >= 25"):
        parse_alloc_conf("max_split_size_mb:20,large_segment_size_mb:25")
    with pytest.raises(AllocatorConfigError, match="unrecognized key 'foo'"):
        parse_alloc_conf("foo:123,bar:456")


@pytest.mark.parametrize(
    "text", ["max_split_size_mb", "max_split_size_mb:", "roundup_power2_divisions:[64:8"]
)
def test_malformed_strings_are_refused_clearly(text: str) -> None:
    """c10's `malformed_config_raises_value_error` (gh-186453): a clean error naming the
    string, not torch 2.13's internal assert."""
    with pytest.raises(AllocatorConfigError, match="allocator config") as raised:
        parse_alloc_conf(text)
    assert "INTERNAL" not in str(raised.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expandable_segments:true", "expected True or False .case-sensitive., got 'true'"),
        ("max_split_size_mb:-1", "expected a non-negative integer, got '-1'"),
        ("max_split_size_mb:40;", "expected a non-negative integer, got '40;'"),
        ("max_split_size_mb:19", "max_split_size_mb too small, must be >= 20, got 19"),
        ("large_segment_size_mb:10", "large_segment_size_mb must be > 10 MB"),
        ("garbage_collection_threshold:1.0", r"set it in \(0.0, 1.0\), got 1.0"),
        ("roundup_power2_divisions:3", "power of 2, got 3"),
        ("roundup_power2_divisions:[48:2]", "intervals have to be powers of 2, got '48'"),
        ("max_split_size_mb:40,,expandable_segments:True", "unrecognized key ','"),
        ("backend:magic", "unknown allocator backend 'magic'"),
        ("per_process_memory_fraction:1.5", r"set it in \[0.0, 1.0\], got 1.5"),
    ],
)
def test_bad_values_name_the_key_and_the_value(text: str, message: str) -> None:
    with pytest.raises(AllocatorConfigError, match=message):
        parse_alloc_conf(text)


def test_every_key_torch_2_13_knows_is_accepted() -> None:
    config = parse_alloc_conf(
        "backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False,"
        "release_lock_on_hipmalloc:False,pinned_use_hip_host_register:False,"
        "graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:8,"
        "pinned_num_register_threads:8,per_process_memory_fraction:0.25,"
        "pinned_free_catch_all:True,throw_on_cudamalloc_oom:False,"
        "pinned_use_background_threads:True,pinned_max_round_threshold_mb:64,"
        "pinned_max_cached_size_mb:128,large_segment_size_mb:32,max_split_size_mb:64,"
        "max_non_split_rounding_mb:32,garbage_collection_threshold:0.9,"
        "roundup_power2_divisions:[>:2],expandable_segments:False"
    )
    assert config.per_process_memory_fraction == 0.25
    assert config.large_segment_bytes == config.max_non_split_rounding_bytes == 32 * MIB
    assert parse_alloc_conf("") == AllocatorConfig()


def test_the_cuda_variable_wins_over_the_generic_one() -> None:
    """`CUDAAllocatorConfig::instance` reads PYTORCH_CUDA_ALLOC_CONF first (and the 2.13.0
    binary keeps `max_split_size_mb:40` when both are set)."""
    both = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:40",
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:50",
    }
    assert config_from_environ(both).max_split_bytes == 40 * MIB
    assert (
        config_from_environ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:50"}).max_split_bytes
        == 50 * MIB
    )
    assert config_from_environ({}) == AllocatorConfig()


# -- differential test against torch's own parser --------------------------------------------

SIZE_VALUES = st.one_of(
    st.integers(0, 200).map(str), st.sampled_from(["-1", "abc", "4.5", "+8", "1e3", ""])
)
FRACTION_VALUES = st.one_of(
    st.floats(-0.5, 1.5, allow_nan=False).map(lambda v: f"{v:.3g}"),
    st.sampled_from(["abc", "nan", "1", "0", ".5", "5e-1"]),
)
BOOL_VALUES = st.sampled_from(["True", "False", "true", "none", ""])
ROUNDUP_ENTRY = st.tuples(
    st.sampled_from(["1", "2", "3", "64", "128", "1024", "65536", "0", ">"]),
    st.integers(0, 20).map(str),
).map(":".join)
ROUNDUP_VALUES = st.one_of(
    st.integers(0, 64).map(str),
    st.lists(ROUNDUP_ENTRY, max_size=5).map(lambda entries: "[" + ",".join(entries) + "]"),
)
# The keys the CPU build's parser validates; the CUDA keys need the CUDA build's parser hook.
KEYS = {
    "large_segment_size_mb": SIZE_VALUES,
    "max_split_size_mb": SIZE_VALUES,
    "max_non_split_rounding_mb": SIZE_VALUES,
    "pinned_max_round_threshold_mb": SIZE_VALUES,
    "garbage_collection_threshold": FRACTION_VALUES,
    "roundup_power2_divisions": ROUNDUP_VALUES,
    "expandable_segments": BOOL_VALUES,
    "pinned_use_background_threads": BOOL_VALUES,
}
SETTING = st.sampled_from(sorted(KEYS)).flatmap(
    lambda key: KEYS[key].map(lambda value: f"{key}:{value}")
)
# Where torch misreads a value instead of refusing it (std::stoull / std::stod read a prefix).
MISREAD_VALUES = {"-1", "4.5", "+8", "1e3", "abc", "1", "0", ".5", "5e-1"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_list=st.lists(SETTING, min_size=1, max_size=4))
# std::stod's out_of_range on a subnormal (found by this test in a full run).
@example(settings_list=["garbage_collection_threshold:2.23e-313"])
def test_torch_accepts_what_we_accept_and_we_refuse_what_torch_refuses(
    settings_list: list[str],
) -> None:
    torch = pytest.importorskip("torch")
    text = ",".join(settings_list)
    torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")  # it persists
    try:
        torch._C._accelerator_setAllocatorSettings(text)
        torch_accepts = True
    except (ValueError, RuntimeError, IndexError):
        torch_accepts = False
    finally:
        torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")
        torch._C._accelerator_setAllocatorSettings("")
    try:
        parse_alloc_conf(text)
    except AllocatorConfigError as error:
        if torch_accepts:
            # Only a value torch misreads may make the two differ.
            assert "expected a" in str(error), (text, str(error))
            assert any(f":{value}" in text for value in MISREAD_VALUES), text
    else:
        assert torch_accepts, text


SPLIT_AND_EXPANDABLE = "max_split_size_mb:128,expandable_segments:True"


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("", None),
        ("expandable_segments:False", None),
        ("roundup_power2_divisions:1", None),  # N = 1 rounds nothing, as 0
        (
            "expandable_segments:True,max_split_size_mb:128",
            "max_split_size_mb:128,expandable_segments:True",
        ),
        (
            "max_split_size_mb:128,expandable_segments:True",
            "max_split_size_mb:128,expandable_segments:True",
        ),
        ("garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ],
)
def test_a_config_has_one_canonical_form(written: str, canonical: str | None) -> None:
    assert canonical_conf(parse_alloc_conf(written)) == canonical
    if canonical is not None:
        assert canonical_conf(parse_alloc_conf(canonical)) == canonical


@given(st.data())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_the_canonical_form_reads_back_to_a_config_that_allocates_the_same(
    data: st.DataObject,
) -> None:
    divisions = data.draw(st.lists(st.sampled_from([0, 1, 2, 4, 8]), min_size=16, max_size=16))
    config = AllocatorConfig(
        max_split_bytes=data.draw(st.sampled_from([None, 21 * MIB, 512 * MIB])),
        roundup_power2_divisions=tuple(divisions),
        garbage_collection_threshold=data.draw(st.sampled_from([0.0, 0.5, 0.875])),
        expandable_segments=data.draw(st.booleans()),
        per_process_memory_fraction=data.draw(st.sampled_from([1.0, 0.25])),
    )
    text = canonical_conf(config)
    back = parse_alloc_conf(text or "")
    same_divisions = tuple(0 if n <= 1 else n for n in divisions)
    assert back == replace(config, roundup_power2_divisions=same_divisions)
    assert canonical_conf(back) == text


def test_the_settings_another_process_gets_are_the_text_read_else_the_canonical_form() -> None:
    """What a worker hands its trial children: the text it read, keys the model ignores
    included (a child's real CUDA reads those too); a config made in code, its canonical form;
    the defaults, nothing."""
    text = "pinned_use_cuda_host_register:True,expandable_segments:True"
    assert settings_text(parse_alloc_conf(text)) == text
    assert parse_alloc_conf(text) == parse_alloc_conf("expandable_segments:True")
    made = AllocatorConfig(expandable_segments=True, max_split_bytes=64 * MIB)
    assert settings_text(made) == "max_split_size_mb:64,expandable_segments:True"
    assert parse_alloc_conf(settings_text(made) or "") == made
    assert settings_text(AllocatorConfig()) is None
