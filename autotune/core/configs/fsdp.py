"""The sharding an FSDP setting stands for, as Axolotl's `fsdp`/`fsdp_config` and a
TrainingArguments file's `fsdp`/`fsdp_config` say it.

Both go through accelerate's FSDP plugin: `reshard_after_forward` (FSDP2, and FSDP1 since
accelerate maps it to a strategy) true is a full shard (zero3), false keeps the parameters
gathered after forward (zero2); FSDP1's strategy names (`full_shard`, `shard_grad_op`,
`hybrid_shard`, `no_shard`; upper case in a `sharding_strategy` key, and in transformers 5 the
value of `reshard_after_forward`) say the same. Keys may carry the old `fsdp_` prefix. Unset,
accelerate shards fully. FSDP1 is measured as FSDP2's per-parameter sharding (the same bytes
per rank, without FSDP1's flat-parameter padding).
"""

from __future__ import annotations

from typing import Any

from autotune.core.configs.conversion import refuse
from autotune.core.schemas import Sharding

_STRATEGIES = {
    "full_shard": Sharding.ZERO3,
    "shard_grad_op": Sharding.ZERO2,
    "hybrid_shard": Sharding.HYBRID,
    "no_shard": Sharding.NONE,
}
# Hybrid sharding that keeps the parameters after forward: no layout autotune measures.
_HYBRID_ZERO2 = "hybrid_shard_zero2"
_OFFLOAD = "offload"


def setting(config: dict[str, Any], name: str) -> Any:
    """`name` in an FSDP config, with or without the `fsdp_` prefix."""
    return config.get(name, config.get(f"fsdp_{name}"))


def fsdp_sharding(
    strategies: list[str],
    config: dict[str, Any],
    *,
    key: str,
    notes: list[str],
    default_version: int,
) -> Sharding:
    """The sharding of FSDP strategy words (`fsdp: [full_shard, auto_wrap]`, or its string)
    and an FSDP config; `default_version` is the FSDP version the consumer runs when the
    config names none.

    Raises:
        SpecError: a strategy that is no measured layout, naming `key`.
    """
    words = [word.lower() for word in strategies]
    for name in ("sharding_strategy", "reshard_after_forward"):
        # transformers 5 keeps FSDP1's strategy name in reshard_after_forward.
        value = setting(config, name)
        if isinstance(value, str):
            words.append(value.lower())
    if _HYBRID_ZERO2 in words:
        raise refuse(key, f"{_HYBRID_ZERO2}: hybrid sharding without resharding is not modelled")
    if _OFFLOAD in words or setting(config, "offload_params") or setting(config, "cpu_offload"):
        notes.append(f"{key}: parameter offloading not modelled (all on the GPU)")
    version = setting(config, "version") or default_version
    if str(version) != "2":
        notes.append(f"{key}: FSDP{version} measured as FSDP2 (per-parameter shards)")
    named = [_STRATEGIES[word] for word in words if word in _STRATEGIES]
    reshard = setting(config, "reshard_after_forward")
    if isinstance(reshard, bool):
        return Sharding.ZERO3 if reshard else Sharding.ZERO2
    return named[-1] if named else Sharding.ZERO3
