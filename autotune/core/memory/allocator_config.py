"""The CUDA caching allocator's settings: its constants, and `PYTORCH_ALLOC_CONF` /
`PYTORCH_CUDA_ALLOC_CONF` strings parsed into a frozen `AllocatorConfig`, as torch 2.13 parses
them (docs/design.md#the-caching-allocator-model).

Sources (torch 2.13): c10's allocator constants and its `ConfigTokenizer`; the device-generic
keys of `AcceleratorAllocatorConfig::parseArgs` and its `parse*` helpers; the CUDA keys of
`CUDAAllocatorConfig::parseArgs`, whose key list is `CUDAAllocatorConfig::getKeys()`.
Torch accepts every string this module accepts; this module is stricter where torch misreads a
string silently: `std::stoull` reads `-1` as 2^64 - 1 and `30;` as 30, and the `:` and `,`
separators are never checked (`ConfigTokenizer::checkToken` returns a bool the parsers ignore),
so `max_split_size_mb:40,,expandable_segments:True` drops its last setting. Those are refused.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from autotune.core.errors import shown

MIB = 1024 * 1024
# c10's allocator constants: kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc, kRoundLarge.
MIN_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 1 * MIB
SMALL_BUFFER_BYTES = 2 * MIB
MIN_LARGE_ALLOC_BYTES = 10 * MIB
ROUND_LARGE_BYTES = 2 * MIB
# AcceleratorAllocatorConfig::large_segment_size_ (kLargeBuffer before 2.10): the segment a
# 1-10 MiB request gets, and the page of an expandable large-pool segment.
LARGE_SEGMENT_BYTES = 20 * MIB
# c10's allocator config: one division count per power-of-two interval from 1 MiB to 64 GiB.
ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20  # 1 MiB
ENVIRONMENT_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class AllocatorConfigError(ValueError):
    """An allocator setting torch would refuse (or silently misread); names key and value."""


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """What the native CUDA caching allocator's policy depends on. The defaults are torch's.

    Attributes:
        large_segment_bytes: `large_segment_size_mb`; segment of a 1-10 MiB request.
        max_split_bytes: `max_split_size_mb`; blocks this large are never split (None: no limit).
        max_non_split_rounding_bytes: `max_non_split_rounding_mb`; how much larger than an
            oversize request a cached oversize block may be and still serve it.
        roundup_power2_divisions: `roundup_power2_divisions`, one count per interval
            [2^k, 2^(k+1)) MiB for k = 0..15 (the last interval is open); 0 or 1: no rounding.
        garbage_collection_threshold: fraction of the memory limit above which cached blocks are
            freed oldest-first before a new segment is made (0: never); only with a limit.
        expandable_segments: one segment per pool that grows by pages instead of new segments.
        per_process_memory_fraction: the limit, as a fraction of the device's memory (1: none).
        backend: `native` (this model) or `cudaMallocAsync` (not modelled).
        settings: the string this was parsed from.
    """

    large_segment_bytes: int = LARGE_SEGMENT_BYTES
    max_split_bytes: int | None = None
    max_non_split_rounding_bytes: int = LARGE_SEGMENT_BYTES
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    settings: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise AllocatorConfigError(
                f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} entries, "
                f"got {len(self.roundup_power2_divisions)}"
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise AllocatorConfigError("garbage_collection_threshold must be in [0, 1)")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise AllocatorConfigError("per_process_memory_fraction must be in [0, 1]")

    def divisions_for(self, size_bytes: int) -> int:
        """The division count that applies to a request of `size_bytes`
        (`AcceleratorAllocatorConfig::roundup_power2_divisions(size_t)`)."""
        index = max(size_bytes.bit_length() - 1 - _ROUNDUP_START_LOG2, 0)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


def config_from_environ(environ: Mapping[str, str]) -> AllocatorConfig:
    """The config a CUDA process started with `environ` uses. `PYTORCH_CUDA_ALLOC_CONF` wins
    over `PYTORCH_ALLOC_CONF` when both are set (`CUDAAllocatorConfig::instance` reads it
    first, and so does the 2.13 binary).

    Raises:
        AllocatorConfigError: the variable's value, named, is not one torch accepts.
    """
    for name in ENVIRONMENT_VARIABLES:
        if name in environ:
            try:
                return parse_alloc_conf(environ[name])
            except AllocatorConfigError as error:
                raise AllocatorConfigError(f"{name}: {error}") from None
    return AllocatorConfig()


def settings_text(config: AllocatorConfig) -> str | None:
    """The `PYTORCH_ALLOC_CONF` text that gives another process `config`: the text it was
    parsed from (keys this model ignores, such as the pinned-memory ones, included), else its
    canonical form; None for torch's defaults given no text."""
    return config.settings or canonical_conf(config)


def canonical_conf(config: AllocatorConfig) -> str | None:
    """The settings that differ from torch's defaults, as one `PYTORCH_ALLOC_CONF` string in a
    fixed order, so that equal configs read the same however they were written (results and
    cache fingerprints compare it); None for the defaults. `parse_alloc_conf` reads it back to
    a config that allocates the same (a division count of 1 rounds nothing, as 0 does, and
    is written as 0)."""
    # N = 1 rounds nothing, as 0 does (`roundup_power2_next_division` tests divisions > 1).
    divisions = tuple(0 if n <= 1 else n for n in config.roundup_power2_divisions)
    config = replace(config, roundup_power2_divisions=divisions, settings="")
    if config == AllocatorConfig():
        return None
    parts = []
    if config.backend != "native":
        parts.append(f"backend:{config.backend}")
    if config.large_segment_bytes != LARGE_SEGMENT_BYTES:
        parts.append(f"large_segment_size_mb:{config.large_segment_bytes // MIB}")
    if config.max_split_bytes is not None:
        parts.append(f"max_split_size_mb:{config.max_split_bytes // MIB}")
    if config.max_non_split_rounding_bytes != LARGE_SEGMENT_BYTES:
        parts.append(f"max_non_split_rounding_mb:{config.max_non_split_rounding_bytes // MIB}")
    if config.roundup_power2_divisions != AllocatorConfig().roundup_power2_divisions:
        # Every interval by its lower boundary in MiB, the last one open.
        *bounded, last = config.roundup_power2_divisions
        entries = [f"{2**k}:{n}" for k, n in enumerate(bounded)] + [f">:{last}"]
        parts.append(f"roundup_power2_divisions:[{','.join(entries)}]")
    if config.garbage_collection_threshold:
        parts.append(f"garbage_collection_threshold:{config.garbage_collection_threshold!r}")
    if config.expandable_segments:
        parts.append("expandable_segments:True")
    if config.per_process_memory_fraction != 1.0:
        parts.append(f"per_process_memory_fraction:{config.per_process_memory_fraction!r}")
    return ",".join(parts)


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """Parse a `PYTORCH_ALLOC_CONF` string (`key:value,key:[a:b,>:c],...`) as torch 2.13 does.

    Raises:
        AllocatorConfigError: an unknown key, a malformed string, or a value torch refuses.
    """
    return _Parser(text).parse()


_INTEGER = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?")
_BOOL_KEYS = frozenset(
    {
        "expandable_segments",
        "pinned_use_background_threads",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)
# Keys that change nothing this model sees (host/pinned memory, locking); validated only.
_SIZE_KEYS = frozenset(
    {
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_reserve_segment_size_mb",
    }
)
# AcceleratorAllocatorConfig::getKeys() and CUDAAllocatorConfig::getKeys(): a CUDA build refuses
# any other key.
_KEYS = (
    _BOOL_KEYS
    | _SIZE_KEYS
    | {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "per_process_memory_fraction",
        "backend",
        "pinned_num_register_threads",
    }
)
_PINNED_MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads
_SIZE_MAX = 2**64 - 1


def _tokenize(text: str) -> list[str]:
    """`ConfigTokenizer`: `, : [ ]` are tokens of their own, whitespace is dropped."""
    tokens: list[str] = []
    buffer = ""
    for char in text:
        if char in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(char)
        elif not char.isspace():
            buffer += char
    if buffer:
        tokens.append(buffer)
    return tokens


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class _Parser:
    """`AcceleratorAllocatorConfig::parseArgs` then `CUDAAllocatorConfig::parseArgs`, over a
    fresh (default) config."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.large_segment_bytes = LARGE_SEGMENT_BYTES
        self.max_split_bytes: int | None = None
        self.max_non_split_rounding_bytes = LARGE_SEGMENT_BYTES
        self.divisions = [0] * ROUNDUP_INTERVALS
        self.garbage_collection_threshold = 0.0
        self.expandable_segments = False
        self.per_process_memory_fraction = 1.0
        self.backend = "native"

    def fail(self, detail: str) -> AllocatorConfigError:
        # The text itself is not repeated (it may be 1,000 characters, and a server would say
        # it back to whoever sent it): the detail names the key, and a short piece of a value.
        return AllocatorConfigError(f"allocator config: {detail}")

    def token(self, index: int, what: str) -> str:
        if index >= len(self.tokens):
            raise self.fail(f"expected {what} at the end")
        return self.tokens[index]

    def expect(self, index: int, token: str) -> None:
        found = self.token(index, repr(token))
        if found != token:
            raise self.fail(f"expected {shown(token)}, got {shown(found)}")

    def integer(self, index: int, key: str) -> int:
        value = self.token(index, f"a value for {key}")
        if not _INTEGER.fullmatch(value):
            raise self.fail(f"{key}: expected a non-negative integer, got {shown(value)}")
        if int(value) > _SIZE_MAX:
            raise self.fail(f"{key}: {value} is out of range")  # std::stoull throws
        return int(value)

    def decimal(self, index: int, key: str) -> float:
        value = self.token(index, f"a value for {key}")
        if not _DECIMAL.fullmatch(value):
            raise self.fail(f"{key}: expected a number, got {shown(value)}")
        number = float(value)
        if number != 0.0 and not sys.float_info.min <= abs(number) <= sys.float_info.max:
            # std::stod throws out_of_range on underflow to a subnormal and on overflow.
            raise self.fail(f"{key}: {value} is out of range")
        return number

    def boolean(self, index: int, key: str) -> bool:
        value = self.token(index, f"a value for {key}")
        if value not in ("True", "False"):
            raise self.fail(f"{key}: expected True or False (case-sensitive), got {shown(value)}")
        return value == "True"

    def megabytes_at_least(self, index: int, key: str, minimum_mb: int) -> int:
        value_mb = self.integer(index, key)
        if value_mb < minimum_mb:
            raise self.fail(f"{key} too small, must be >= {minimum_mb}, got {value_mb}")
        return min(value_mb, _SIZE_MAX // MIB) * MIB

    def parse(self) -> AllocatorConfig:
        # large_segment_size_mb first, wherever it is: two minimums below depend on it.
        for index, key in enumerate(self.tokens):
            if key == "large_segment_size_mb":
                self.expect(index + 1, ":")
                value_mb = self.integer(index + 2, key)
                if value_mb <= MIN_LARGE_ALLOC_BYTES // MIB:
                    raise self.fail(f"{key} must be > {MIN_LARGE_ALLOC_BYTES // MIB} MB")
                self.large_segment_bytes = min(value_mb, _SIZE_MAX // MIB) * MIB
        self.max_non_split_rounding_bytes = self.large_segment_bytes
        index = 0
        while index < len(self.tokens):
            index = self.key(index)
            if index + 1 < len(self.tokens):
                self.expect(index + 1, ",")
                index += 1
            index += 1
        return AllocatorConfig(
            large_segment_bytes=self.large_segment_bytes,
            max_split_bytes=self.max_split_bytes,
            max_non_split_rounding_bytes=self.max_non_split_rounding_bytes,
            roundup_power2_divisions=tuple(self.divisions),
            garbage_collection_threshold=self.garbage_collection_threshold,
            expandable_segments=self.expandable_segments,
            per_process_memory_fraction=self.per_process_memory_fraction,
            backend=self.backend,
            settings=self.text,
        )

    def key(self, index: int) -> int:
        """Parse the key at `index` and its value; return the index of the value's last token."""
        key = self.tokens[index]
        if key not in _KEYS:
            raise self.fail(f"unrecognized key {shown(key)}")
        if key == "large_segment_size_mb":
            return self.skip(index)
        self.expect(index + 1, ":")
        value = index + 2
        minimum_mb = self.large_segment_bytes // MIB
        if key == "max_split_size_mb":
            self.max_split_bytes = self.megabytes_at_least(value, key, minimum_mb)
        elif key == "max_non_split_rounding_mb":
            self.max_non_split_rounding_bytes = self.megabytes_at_least(value, key, minimum_mb)
        elif key == "garbage_collection_threshold":
            threshold = self.decimal(value, key)
            if not 0.0 < threshold < 1.0:
                raise self.fail(f"{key} is invalid, set it in (0.0, 1.0), got {threshold}")
            self.garbage_collection_threshold = threshold
        elif key == "roundup_power2_divisions":
            return self.roundup(value)
        elif key == "per_process_memory_fraction":
            fraction = self.decimal(value, key)
            if not 0.0 <= fraction <= 1.0:
                raise self.fail(f"{key} is invalid, set it in [0.0, 1.0], got {fraction}")
            self.per_process_memory_fraction = fraction
        elif key == "backend":
            backend = self.token(value, f"a value for {key}")
            if backend not in ("native", "cudaMallocAsync"):
                raise self.fail(
                    f"unknown allocator backend {shown(backend)} (native, cudaMallocAsync)"
                )
            self.backend = backend
        elif key == "expandable_segments":
            self.expandable_segments = self.boolean(value, key)
        elif key in _BOOL_KEYS:
            self.boolean(value, key)
        elif key == "pinned_num_register_threads":
            threads = self.integer(value, key)
            if not _is_power_of_two(threads) or threads > _PINNED_MAX_REGISTER_THREADS:
                raise self.fail(f"{key} must be a power of 2 <= {_PINNED_MAX_REGISTER_THREADS}")
        elif self.integer(value, key) == 0 and key == "pinned_reserve_segment_size_mb":
            raise self.fail(f"{key} has to be greater than 0")
        return value

    def skip(self, index: int) -> int:
        """`ConfigTokenizer::skipKey`: past `key:value` or `key:[...]`."""
        self.expect(index + 1, ":")
        index += 2
        if self.token(index, "a value") != "[":
            return index
        while self.token(index, "']'") != "]":
            index += 1
        return index

    def roundup(self, index: int) -> int:
        """`parseRoundUpPower2Divisions`: `N` for every interval, or `[MB:N,...,>:N]`."""
        key = "roundup_power2_divisions"
        if self.token(index, f"a value for {key}") != "[":
            divisions = self.integer(index, key)
            if not _is_power_of_two(divisions):
                raise self.fail(f"{key}: the divisions have to be a power of 2, got {divisions}")
            self.divisions[:] = [divisions] * ROUNDUP_INTERVALS
            return index
        first = True
        last_slot = 0
        index += 1
        while self.token(index, "']'") != "]":
            boundary = self.tokens[index]
            self.expect(index + 1, ":")
            divisions = self.integer(index + 2, key)
            index += 2
            if divisions != 0 and not _is_power_of_two(divisions):
                raise self.fail(f"{key}: divisions have to be a power of 2 or 0, got {divisions}")
            if boundary == ">":
                self.divisions[last_slot + 1 :] = [divisions] * (ROUNDUP_INTERVALS - last_slot - 1)
            else:
                if not _INTEGER.fullmatch(boundary) or not _is_power_of_two(int(boundary)):
                    raise self.fail(
                        f"{key}: intervals have to be powers of 2, got {shown(boundary)}"
                    )
                slot = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    # The first boundary also sets every interval below it.
                    self.divisions[:slot] = [divisions] * slot
                    first = False
                self.divisions[slot] = divisions
                last_slot = slot
            if self.token(index + 1, "']'") != "]":
                self.expect(index + 1, ",")
                index += 1
            index += 1
        return index
