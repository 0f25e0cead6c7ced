"""Which 8-bit AdamW `optimizer: adamw8bit` is, per sharding, and the bytes of state it keeps
per parameter: the one place the engine (which measures it) and the exports (which name it)
read it from (docs/design.md#weights-and-optimizer-states).

Whole parameters (no sharding, DDP, ZeRO-1) train with bitsandbytes' `AdamW8bit`; FSDP2's
sharded parameters (zero2, zero3, hybrid) with torchao's, since bitsandbytes' does not support
DTensors (its kernels view a parameter whole; Axolotl refuses the pair). Their states differ:

* bitsandbytes 0.4x (`Optimizer2State.init_state`, `min_8bit_size=4096`, block-wise): a
  parameter of fewer than 4096 elements keeps two fp32 states; any other two uint8 states and
  two fp32 absmax vectors, one value per block of 256 elements (the last block padded); two
  256-entry fp32 quantisation maps are shared by all parameters.
* torchao 0.1x (`_AdamBase._new_buffer`): a rank's shard of at least 4096 elements that is a
  whole number of 256-element blocks keeps, per state, uint8 codes, one fp32 scale per block and
  its own 256-entry fp32 map; any other shard (a vocabulary of 3001 rows over 2 ranks leaves
  1501 rows on the first) keeps two states of the parameter's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from autotune.core.schemas import Sharding

MIN_8BIT_ELEMENTS = 4096  # both libraries' threshold (bitsandbytes' min_8bit_size)
BLOCK_ELEMENTS = 256  # both libraries' quantisation block
QMAP_ENTRIES = 256
_FP32_BYTES = 4


class Library(StrEnum):
    BITSANDBYTES = "bitsandbytes"
    TORCHAO = "torchao"


@dataclass(frozen=True)
class EightBitAdamW:
    """One library's 8-bit AdamW, as a script builds it."""

    library: Library  # the distribution to install
    class_path: str  # importable as module.Class
    hf_optim: str  # transformers' `TrainingArguments.optim` that builds this class


BITSANDBYTES_ADAMW_8BIT = EightBitAdamW(
    Library.BITSANDBYTES, "bitsandbytes.optim.AdamW8bit", "adamw_bnb_8bit"
)
TORCHAO_ADAMW_8BIT = EightBitAdamW(Library.TORCHAO, "torchao.optim.AdamW8bit", "adamw_torch_8bit")


# The shardings of FSDP2, whose optimizers see each rank's shard of a parameter (a DTensor).
FSDP2_SHARDINGS = (Sharding.ZERO2, Sharding.ZERO3, Sharding.HYBRID)


def eight_bit_adamw(sharding: Sharding) -> EightBitAdamW:
    """The 8-bit AdamW measured (and exported) for `optimizer: adamw8bit` with `sharding`."""
    return TORCHAO_ADAMW_8BIT if sharding in FSDP2_SHARDINGS else BITSANDBYTES_ADAMW_8BIT


def is_8bit(numel: int, library: Library) -> bool:
    """Whether `library` keeps a parameter (a rank's shard of it, under FSDP2) of `numel`
    elements in 8 bits."""
    if numel < MIN_8BIT_ELEMENTS:
        return False
    return library is Library.BITSANDBYTES or numel % BLOCK_ELEMENTS == 0


def state_bytes(numel: int, library: Library, *, param_bytes: int = _FP32_BYTES) -> int:
    """Bytes of the two AdamW states `library` keeps for a parameter (or shard) of `numel`
    elements of `param_bytes` each (bitsandbytes' shared maps aside)."""
    if not is_8bit(numel, library):
        element_bytes = _FP32_BYTES if library is Library.BITSANDBYTES else param_bytes
        return 2 * element_bytes * numel
    blocks = -(-numel // BLOCK_ELEMENTS)
    maps = 2 * _FP32_BYTES * QMAP_ENTRIES if library is Library.TORCHAO else 0
    return 2 * numel + 2 * _FP32_BYTES * blocks + maps
