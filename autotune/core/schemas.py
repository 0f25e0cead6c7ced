"""Pydantic models shared by the CLI, the core library, the API server and the probe workers.

Torch-free on purpose: `api/` imports this module and must install and start without torch.
Every payload that crosses a process or network boundary is one of these models.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SkipValidation, model_validator

from autotune.core.bytesize import format_bytes
from autotune.core.errors import SpecError, shown
from autotune.core.hubid import HUB_ID_MAX, hub_id_problem
from autotune.core.memory.resident_placement import TrialStart
from autotune.core.presets import PRESETS, CNNPreset, DecoderPreset

if TYPE_CHECKING:
    from autotune.core.memory.allocator import AllocatorStats

# Column sizes in api/store/tables.py: a longer value would pass SQLite and fail PostgreSQL, so the
# schemas refuse it first and both databases answer the same 422.
MODEL_LABEL_MAX = 300  # autotune_runs.model
STUDY_NAME_MAX = 100  # autotune_runs.study_name
TORCH_VERSION_MAX = 32  # autotune_runs.torch_version
TRANSFORMERS_VERSION_MAX = 64
# A rate or a duration as a worker reports it: a measurement is finite and above zero (a zero,
# a subnormal or an infinity breaks every ratio and logarithm drawn from it).
PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
DEVICE_NAME_MAX = 200  # autotune_runs.target_name
_MODEL_TYPE_MAX = MODEL_LABEL_MAX - len("hf:")
# Topology bounds: far beyond any job, and small enough that world_size stays a small integer.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024
DEFAULT_INTER_NODE_GBPS = 400.0
# The topology fields a one-node spec leaves out of its identity (`Spec.identity`).
_TOPOLOGY_FIELDS = ("nodes", "gpus_per_node", "inter_node_gbps")


class FrozenModel(BaseModel):
    """Frozen and strict about unknown fields, so a typo in a spec is an error, not a no-op."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# The spec: what to train, and how.


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast to bfloat16, fp32 master weights
    FP16 = "fp16"  # autocast to float16 with a gradient scaler


class WeightsDtype(StrEnum):
    """What the parameters (and so their gradients and optimizer states) are stored in."""

    FP32 = "fp32"  # fp32 master weights, whatever the compute precision
    BF16 = "bf16"  # bf16 weights, no fp32 master copy (torch_dtype=bfloat16 fine-tuning)


class Sharding(StrEnum):
    """How data-parallel ranks share the training state (docs/design.md#sharded-data-parallel)."""

    NONE = "none"  # DDP: every rank holds everything
    ZERO1 = "zero1"  # optimizer states sharded
    ZERO2 = "zero2"  # and gradients (FSDP SHARD_GRAD_OP: parameters kept after forward)
    ZERO3 = "zero3"  # and parameters: FSDP full shard, each block gathered while it runs
    HYBRID = "hybrid"  # full shard within groups of shard_group_size ranks, replicated across
    # The tuner measures every layout valid for the topology and recommends one
    # (autotune.core.parallel.layout_choice); never a layout a step runs with.
    AUTO = "auto"

    @property
    def is_layout(self) -> bool:
        """A layout a step runs with (not `auto`, the tuner's choice among them)."""
        return self is not Sharding.AUTO


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"  # with momentum, so it keeps one state tensor per parameter like real runs
    ADAFACTOR = "adafactor"
    # bitsandbytes' AdamW8bit, whose state sizes autotune.engine.training.adamw_8bit allocates
    ADAMW_8BIT = "adamw8bit"


HF_CONFIG_DEPTH_MAX = 16


def nesting_depth(value: object) -> int:
    """How many dicts and lists deep `value` goes (0 for a scalar); iterative, so any depth is
    measured without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list | tuple):
            children = list(item)
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


_FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


class ModelSpec(FrozenModel):
    """Exactly one of `preset`, `hf_config`, `hf_id` or `factory`."""

    preset: str | None = Field(default=None, description="Name of a built-in model.")
    hf_config: dict[str, Any] | None = Field(
        default=None,
        description='A transformers config as a dict, e.g. {"model_type": "llama", ...}; '
        "built with random weights, nothing downloaded.",
    )
    hf_id: str | None = Field(
        default=None,
        max_length=HUB_ID_MAX,
        description="A Hugging Face hub id, 'name' or 'namespace/name' (needs the hub or its "
        "local cache; never a local directory).",
    )
    factory: str | None = Field(
        default=None,
        max_length=MODEL_LABEL_MAX,
        description=(
            '"package.module:function" returning an autotune.engine.training.workload.Workload.'
        ),
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSpec:
        given = [
            name for name in ("preset", "hf_config", "hf_id", "factory") if getattr(self, name)
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of preset, hf_config, hf_id, factory"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"preset: unknown preset {shown(self.preset)}; choose one of {', '.join(PRESETS)}"
            )
        if self.hf_config is not None and not isinstance(self.hf_config.get("model_type"), str):
            raise ValueError('hf_config: needs a "model_type" string, e.g. "llama"')
        if self.hf_config is not None and len(self.hf_config["model_type"]) > _MODEL_TYPE_MAX:
            raise ValueError(f"hf_config.model_type: at most {_MODEL_TYPE_MAX} characters")
        if self.hf_config is not None and nesting_depth(self.hf_config) > HF_CONFIG_DEPTH_MAX:
            # Real configs nest a few levels; hundreds break serialising (and fingerprinting).
            raise ValueError(f"hf_config: nested deeper than {HF_CONFIG_DEPTH_MAX} levels")
        if self.hf_config is not None and "auto_map" in self.hf_config:
            raise ValueError("hf_config.auto_map: names remote code, which autotune never runs")
        if self.hf_id is not None and (problem := hub_id_problem(self.hf_id)) is not None:
            raise ValueError(f"hf_id: not a Hugging Face hub id: {problem}")
        if self.factory is not None and not _FACTORY_PATTERN.fullmatch(self.factory):
            raise ValueError('factory: expected "package.module:function"')
        return self

    @property
    def is_token_model(self) -> bool | None:
        """True for language models, False for fixed-shape inputs, None when only the
        user's factory knows."""
        if self.preset is not None:
            return PRESETS[self.preset].kind == "decoder"
        if self.factory is not None:
            return None
        return True

    @property
    def label(self) -> str:
        """A short human name for listings."""
        if self.preset is not None:
            return self.preset
        if self.hf_id is not None:
            return self.hf_id
        if self.factory is not None:
            return self.factory
        assert self.hf_config is not None
        return f"hf:{self.hf_config['model_type']}"


# A module's name or dotted suffix, as in named_modules(): no quotes or spaces to escape.
ModuleName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\w.\-]+$")]


class LoraSpec(FrozenModel):
    """LoRA adapters on a frozen base model, built with the `peft` library (the `lora` extra).
    Key names follow peft's `LoraConfig` where they can: `r`, `alpha` (lora_alpha), `dropout`
    (lora_dropout), `target_modules`, `modules_to_save`."""

    r: int = Field(default=16, ge=1, le=65536, description="Adapter rank.")
    alpha: float = Field(default=32.0, gt=0, description="lora_alpha: the update's scale.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="lora_dropout on each adapter's input."
    )
    target_modules: Literal["all-linear"] | Annotated[list[ModuleName], Field(min_length=1)] = (
        Field(
            default="all-linear",
            description='Module names (or name suffixes) to adapt, or "all-linear": every linear '
            "layer but the output head.",
        )
    )
    modules_to_save: list[ModuleName] = Field(
        default_factory=list,
        max_length=64,
        description="Modules trained in full beside the adapters (peft keeps a trainable "
        "copy), e.g. lm_head or embed_tokens.",
    )


class TrainingSpec(FrozenModel):
    seq_len: int | None = Field(default=None, ge=1, description="Tokens per sample.")
    input_shape: tuple[int, ...] | None = Field(
        default=None, description="Shape of one sample for non-token models, e.g. [3, 32, 32]."
    )
    precision: Precision = Precision.FP32
    tf32: bool | None = Field(
        default=None,
        description="TF32 for fp32 matmuls and cuDNN convolutions on a CUDA device (faster, "
        "10-bit mantissa); None keeps torch's defaults (matmuls IEEE, convolutions TF32).",
    )
    weights: WeightsDtype = Field(
        default=WeightsDtype.FP32,
        description="fp32: master weights in fp32 (autocast computes in `precision`); bf16: "
        "parameters, gradients and optimizer states in bf16 with no fp32 copy (needs "
        "precision bf16).",
    )
    optimizer: OptimizerName = OptimizerName.ADAMW
    lora: LoraSpec | None = Field(
        default=None,
        description="Train LoRA adapters on the frozen model instead of every parameter.",
    )
    target_global_batch: int | None = Field(
        default=None, ge=1, description="Samples per optimizer step across all ranks."
    )
    target_global_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per optimizer step across all ranks, the way LLM papers state the "
        "batch size; needs seq_len, and sets target_global_batch = tokens / seq_len (packed "
        "sequences: every sample holds seq_len tokens).",
    )
    world_size: int = Field(
        default=1,
        ge=1,
        description="Data-parallel ranks, one per GPU: nodes x gpus_per_node. Given alone, "
        "that many GPUs of one node (hybrid sharding alone: one node per shard group).",
    )
    nodes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NODES,
        description="Machines the ranks span; None: one (hybrid sharding: world_size / "
        "shard_group_size, a node per shard group).",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GPUS_PER_NODE,
        description="GPUs (ranks) on each node; world_size = nodes x gpus_per_node.",
    )
    inter_node_gbps: float = Field(
        default=DEFAULT_INTER_NODE_GBPS,
        gt=0,
        le=100_000,
        description="Network bandwidth out of each node, in Gb/s, for communication between "
        "nodes (default 400: one 400 Gb/s NIC per node, e.g. one InfiniBand NDR port); "
        "read only when the ranks span several nodes.",
    )
    sharding: Sharding = Field(
        default=Sharding.NONE,
        description="none (DDP) | zero1 | zero2 | zero3 (= FSDP full shard) | hybrid (full "
        "shard within groups of shard_group_size ranks) | auto (the tuner measures every "
        "layout valid for the topology, hybrid with the node as its shard group, and "
        "recommends the fastest).",
    )
    shard_group_size: int | None = Field(
        default=None,
        ge=2,
        description="hybrid: ranks that shard among themselves (GPUs per node, typically 8).",
    )
    headroom: float = Field(
        default=0.05, ge=0.0, lt=1.0, description="Fraction of capacity to leave free."
    )
    max_micro_batch: int = Field(default=1024, ge=1, description="Search cap.")

    @model_validator(mode="before")
    @classmethod
    def _world_from_topology(cls, data: Any) -> Any:
        """nodes x gpus_per_node sets world_size (a world_size given as well must agree, which
        `_check_topology` says); nodes with world_size alone set gpus_per_node when they divide
        it; a hybrid spec given as nodes x gpus_per_node shards within each node unless it
        says otherwise."""
        if not isinstance(data, dict):
            return data
        nodes, per_node = data.get("nodes"), data.get("gpus_per_node")
        world = data.get("world_size")
        update: dict[str, Any] = {}
        if type(per_node) is int and world is None and (nodes is None or type(nodes) is int):
            update["world_size"] = (nodes or 1) * per_node
        elif per_node is None and type(nodes) is int and type(world) is int and nodes > 0:
            if world % nodes == 0 and world >= nodes:
                update["gpus_per_node"] = world // nodes
        hybrid = data.get("sharding") in (Sharding.HYBRID, Sharding.HYBRID.value)
        given_per_node = update.get("gpus_per_node", per_node)
        if hybrid and data.get("shard_group_size") is None and type(given_per_node) is int:
            update["shard_group_size"] = given_per_node
        return {**data, **update} if update else data

    @model_validator(mode="before")
    @classmethod
    def _samples_from_tokens(cls, data: Any) -> Any:
        """A token target is stored with the sample target it stands for, so that everything
        downstream (candidates, checks, exports) reads one `target_global_batch`; `_shape`
        then checks that the two agree."""
        if not isinstance(data, dict) or data.get("target_global_batch") is not None:
            return data
        tokens, seq_len = data.get("target_global_tokens"), data.get("seq_len")
        if type(tokens) is int and type(seq_len) is int and seq_len > 0 and tokens % seq_len == 0:
            return {**data, "target_global_batch": tokens // seq_len}
        return data

    @model_validator(mode="after")
    def _shape(self) -> TrainingSpec:
        self._check_topology()
        self._check_sharding()
        if self.weights is WeightsDtype.BF16 and self.precision is not Precision.BF16:
            raise ValueError(
                "training.weights: bf16 weights compute in bf16; set precision: bf16 (fp16's "
                "gradient scaler needs fp32 master weights)"
            )
        if self.target_global_tokens is not None:
            self._check_token_target(self.target_global_tokens)
        if self.seq_len is not None and self.input_shape is not None:
            raise ValueError("give seq_len (token models) or input_shape, not both")
        if self.input_shape is not None and (
            not self.input_shape or any(d < 1 for d in self.input_shape)
        ):
            raise ValueError("input_shape: every dimension must be >= 1")
        return self

    @property
    def node_count(self) -> int:
        """Nodes the ranks span: `nodes`, else one, or for hybrid sharding one node per shard
        group (the way hybrid specs said it before `nodes` existed)."""
        if self.nodes is not None:
            return self.nodes
        if self.sharding is Sharding.HYBRID and self.shard_group_size is not None:
            return self.world_size // self.shard_group_size
        return 1

    @property
    def ranks_per_node(self) -> int:
        """GPUs (ranks) on each node."""
        return self.world_size // self.node_count

    def _check_topology(self) -> None:
        nodes, per_node = self.nodes, self.gpus_per_node
        if nodes is not None and per_node is None and nodes > 1:
            raise ValueError(
                f"training.gpus_per_node: needed with nodes {nodes} (world_size "
                f"{self.world_size} is not nodes x a whole number of GPUs)"
            )
        if per_node is not None and (nodes or 1) * per_node != self.world_size:
            raise ValueError(
                f"training.world_size: {self.world_size}, but nodes x gpus_per_node is "
                f"{nodes or 1} x {per_node} = {(nodes or 1) * per_node}; give one of the two"
            )
        said = self.nodes is not None or self.shard_group_size is not None
        if self.sharding is Sharding.HYBRID and said and self.node_count < 2:
            raise ValueError(
                "training.sharding: hybrid shards within a node and replicates across nodes; "
                "on one node it is zero3 (set nodes and gpus_per_node, or use zero3)"
            )
        group = self.shard_group_size
        if self.sharding is Sharding.HYBRID and group is not None and self.nodes is not None:
            per_node = self.ranks_per_node
            if self.world_size % group == 0 and per_node % group and group % per_node:
                raise ValueError(
                    f"training.shard_group_size: {group} neither divides nor is a multiple of "
                    f"gpus_per_node {per_node}: a shard group would straddle nodes unevenly"
                )

    def _check_sharding(self) -> None:
        if self.sharding is Sharding.AUTO and self.target_global_batch is None:
            raise ValueError(
                "training.sharding: auto chooses the layout by samples/s at the target; set "
                "target_global_batch (or target_global_tokens), or name a layout"
            )
        if self.sharding not in (Sharding.NONE, Sharding.AUTO) and self.world_size < 2:
            raise ValueError(
                f"training.sharding: {self.sharding} shards across ranks; set world_size >= 2"
            )
        group = self.shard_group_size
        if self.sharding is Sharding.HYBRID:
            if group is None:
                raise ValueError(
                    "training.shard_group_size: hybrid sharding needs the ranks per shard "
                    "group (GPUs per node, typically 8)"
                )
            if self.world_size % group or group >= self.world_size:
                raise ValueError(
                    f"training.shard_group_size: {group} must divide world_size "
                    f"{self.world_size} and be smaller (equal is zero3)"
                )
        elif group is not None:
            auto = (
                " (auto's hybrid candidate shards within each node)"
                if self.sharding is Sharding.AUTO
                else ""
            )
            raise ValueError(f"training.shard_group_size: only for sharding: hybrid{auto}")

    def with_layout(self, sharding: Sharding) -> TrainingSpec:
        """This section with `sharding` as its layout: hybrid shards within each node (the
        node is the shard group), every other layout has no shard group.

        Raises:
            pydantic.ValidationError: the layout is not valid for the topology (hybrid on one
                node, sharding on one rank).
        """
        group = self.ranks_per_node if sharding is Sharding.HYBRID else None
        fields = self.model_dump(exclude={"shard_group_size", "sharding"})
        return TrainingSpec.model_validate(
            {**fields, "sharding": sharding, "shard_group_size": group}
        )

    def _check_token_target(self, tokens: int) -> None:
        if self.seq_len is None:
            raise ValueError(
                "training.target_global_tokens: needs training.seq_len (tokens per sample)"
            )
        samples, remainder = divmod(tokens, self.seq_len)
        if remainder:
            nearest = [n for n in (samples, samples + 1) if n > 0]
            raise ValueError(
                f"training.target_global_tokens: {tokens} is not a multiple of seq_len "
                f"{self.seq_len} (packed sequences: every sample holds {self.seq_len} tokens); "
                "the nearest token targets are "
                + " and ".join(f"{n * self.seq_len} ({n} samples)" for n in nearest)
            )
        if self.target_global_batch != samples:
            raise ValueError(
                f"training.target_global_batch: {self.target_global_batch}, but "
                f"target_global_tokens {tokens} / seq_len {self.seq_len} is {samples} samples; "
                "give one of the two"
            )

    def required_target_global_batch(self) -> int:
        """The target global batch, which tuning needs (probing does not).

        Raises:
            SpecError: the spec sets none.
        """
        if self.target_global_batch is None:
            raise SpecError(
                "training.target_global_batch: required for tuning (or target_global_tokens)"
            )
        return self.target_global_batch


class Spec(FrozenModel):
    """One training set-up to probe or tune: a model and how it is trained."""

    model: ModelSpec
    training: TrainingSpec = TrainingSpec()

    def identity(self) -> dict[str, Any]:
        """The spec as a fingerprint reads it (JSON, defaults filled in), without the topology
        fields a spec written before they existed could not hold: on one node all of them
        (`world_size` says it all: `nodes: 1, gpus_per_node: 8` and `world_size: 8` are one
        spec), else those left unset, and the default network of a hybrid spec that gives no
        nodes. So stored specs keep their fingerprints, and their cached results answer."""
        dumped = self.model_dump(mode="json")
        training, fields = self.training, dumped["training"]
        for name in _TOPOLOGY_FIELDS:
            if training.node_count == 1 or fields[name] is None:
                fields.pop(name)
        default_network = training.inter_node_gbps == DEFAULT_INTER_NODE_GBPS
        if training.nodes is None and default_network:
            fields.pop("inter_node_gbps", None)
        return dumped

    def with_training(self, changes: dict[str, Any]) -> Spec:
        """This spec with `changes` to its training section, validated again. A token target
        is dropped with a new `seq_len` (it was a number of samples of the old length), and a
        change of the ranks (`world_size`, or `nodes` and `gpus_per_node`) replaces all of the
        topology's fields.

        Raises:
            pydantic.ValidationError: the changed spec is not valid.
        """
        training = self.training.model_dump(exclude_unset=True)
        if "seq_len" in changes:
            training.pop("target_global_tokens", None)
        if changes.keys() & {"world_size", "nodes", "gpus_per_node"}:
            for name in ("world_size", "nodes", "gpus_per_node", "shard_group_size"):
                training.pop(name, None)
        return Spec.model_validate(
            {"model": self.model.model_dump(exclude_unset=True), "training": training | changes}
        )

    @model_validator(mode="after")
    def _inputs_match_model(self) -> Spec:
        token_model = self.model.is_token_model
        if token_model is True and self.training.input_shape is not None:
            raise ValueError("training.input_shape: this is a token model; give seq_len instead")
        if token_model is False and self.training.seq_len is not None:
            raise ValueError(
                "training.seq_len: this model takes fixed-shape inputs; give input_shape instead"
            )
        if self.model.preset is None and token_model and self.training.seq_len is None:
            raise ValueError("training.seq_len: required for Hugging Face models")
        preset = PRESETS.get(self.model.preset) if self.model.preset is not None else None
        seq_len, input_shape = self.training.seq_len, self.training.input_shape
        # Shapes the preset cannot take are refused here, not when a worker builds the model.
        if isinstance(preset, DecoderPreset) and seq_len is not None:
            if seq_len > preset.max_seq_len:
                raise ValueError(
                    f"training.seq_len: {seq_len} exceeds the max_seq_len {preset.max_seq_len} "
                    f"of preset {self.model.preset!r}"
                )
        if isinstance(preset, CNNPreset) and input_shape is not None and len(input_shape) != 3:
            raise ValueError(
                f"training.input_shape: the cnn preset needs [C, H, W], got {list(input_shape)}"
            )
        return self


# ---------------------------------------------------------------------------------------------
# Devices and probe results.


class DeviceKind(StrEnum):
    CUDA = "cuda"
    EMULATED = "emulated"  # a CPU run with a live-byte tracker enforcing a capacity
    ESTIMATE = "estimate"  # the emulated GPU's step traced on fake tensors: nothing ran


class SpeedSource(StrEnum):
    """Where a device's samples/s come from."""

    MEASURED = "measured"  # timed on the GPU itself
    CPU_TIMING = "cpu_timing"  # timed on the host CPU running the emulated step: no GPU's speed
    ROOFLINE = "roofline"  # the traced step's roofline on the named GPU (stated assumptions)


class CudaReserve(FrozenModel):
    """What CUDA takes on a named GPU besides the training step's own tensors, and where it
    sits (`autotune.core.gpus.cuda_reserve`, docs/design.md#named-gpus-and-what-cuda-takes)."""

    context_bytes: int = Field(
        ge=0,
        description="The CUDA context with lazily loaded kernels; outside the caching allocator.",
    )
    nccl_bytes: int = Field(
        ge=0,
        description="NCCL's buffers and kernels when world_size > 1; outside the caching "
        "allocator.",
    )
    blas_workspace_bytes: int = Field(
        ge=0,
        description="cuBLAS and cuBLASLt workspaces: allocated through the caching allocator "
        "and held for the process's life, so resident in every step (inside the capacity).",
    )
    kernel_workspace_bytes: int = Field(
        default=0,
        ge=0,
        description="Allowance left free below the capacity for what kernels allocate inside "
        "one op; 0: attention's scratch is counted in the op, cuDNN falls back to smaller "
        "workspaces.",
    )

    @property
    def outside_allocator_bytes(self) -> int:
        return self.context_bytes + self.nccl_bytes


ASSUMPTION_MAX = 300  # characters of one stated assumption
ALLOCATOR_CONF_MAX = 1000  # characters of a canonical PYTORCH_ALLOC_CONF


class DeviceInfo(FrozenModel):
    """Identity and memory of the device a result was measured on. An emulated named GPU also
    says which GPU (`gpu`, a catalogue name of `autotune.core.gpus.catalogue`), what CUDA takes on
    it (`reserve`) and every assumption behind its capacity (`assumptions`)."""

    kind: DeviceKind
    name: str = Field(max_length=DEVICE_NAME_MAX)
    index: int | None = None
    uuid: str | None = Field(default=None, max_length=200)
    total_memory_bytes: int = Field(ge=0)
    capacity_bytes: int = Field(ge=0, description="What a training step may use.")
    driver_version: str | None = Field(default=None, max_length=100)
    cuda_version: str | None = Field(default=None, max_length=100)
    torch_version: str | None = Field(default=None, max_length=TORCH_VERSION_MAX)
    gpu: str | None = Field(
        default=None, max_length=DEVICE_NAME_MAX, description="The named GPU emulated."
    )
    reserve: CudaReserve | None = None
    allocator_conf: str | None = Field(
        default=None,
        max_length=ALLOCATOR_CONF_MAX,
        description="The caching allocator's settings (PYTORCH_ALLOC_CONF) that differ from "
        "torch's defaults, in canonical form; None: the defaults.",
    )
    assumptions: list[Annotated[str, Field(max_length=ASSUMPTION_MAX)]] = Field(
        default_factory=list, max_length=32
    )
    speed: SpeedSource | None = Field(
        default=None,
        description="Where samples/s come from: measured on the GPU, CPU timings of the "
        "emulated step, or the roofline of the traced step on the named GPU; None where no "
        "speed is given (an estimate for a bare size) or recorded.",
    )


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


OOM_OP_MAX = 200  # characters of the op an allocation failed in


class StepKind(StrEnum):
    """Which step a runner is about to run (what the CLI's progress announces)."""

    WARM_UP = "warm-up"
    TRIAL = "trial"  # a tracked step: does it fit, its peak
    MEASURE = "measure"  # a fit check, then timed steps


class OomDetail(FrozenModel):
    """The allocation that did not fit, and what the memory held at that moment: the trained
    model's weights, its gradients, the optimizer's state, everything else allocated (the
    activations kept for backward, temporaries, workspaces) and the caching allocator's
    cache (reserved, not allocated)."""

    allocation_bytes: int = Field(ge=0, description="The allocation that failed.")
    phase: Phase
    op: str = Field(max_length=OOM_OP_MAX, description="The op whose outputs it was for.")
    weights_bytes: int = Field(ge=0)
    gradients_bytes: int = Field(ge=0)
    optimizer_state_bytes: int = Field(ge=0)
    activations_bytes: int = Field(
        ge=0, description="Every other allocated byte: activations, temporaries, workspaces."
    )
    cache_bytes: int = Field(ge=0, description="Reserved by the caching allocator, unallocated.")

    def summary(self) -> str:
        """One line for people: what failed, where, and what the memory held."""
        held = ", ".join(
            f"{name} {format_bytes(size_bytes)}"
            for name, size_bytes in (
                ("weights", self.weights_bytes),
                ("gradients", self.gradients_bytes),
                ("optimizer state", self.optimizer_state_bytes),
                ("activations and temporaries", self.activations_bytes),
                ("cache", self.cache_bytes),
            )
        )
        return (
            f"{format_bytes(self.allocation_bytes)} for {self.op} in {self.phase.value} did "
            f"not fit; memory held: {held}"
        )


class StepOutcome(FrozenModel):
    """What one complete training step (forward, backward, optimizer step) at one micro-batch
    showed. The one record of a step's memory outcome: the device fills it, the search reads it,
    the probe reports it and the server stores it."""

    micro_batch: int = Field(ge=1)
    fits: bool
    peak_bytes: int = Field(
        ge=0,
        description="Peak reserved memory (the caching allocator's segments: what has to fit "
        "in the capacity) of what ran, before the OOM if any.",
    )
    peak_allocated_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Peak allocated memory (live tensor blocks, torch.cuda.max_memory_allocated); "
        "None when not measured.",
    )
    num_alloc_retries: int | None = Field(
        default=None,
        ge=0,
        description="Times the allocator freed its cache and retried a malloc; None when not "
        "measured.",
    )
    phase_peak_bytes: dict[Phase, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="Peak live tensor bytes in each phase that ran."
    )
    oom_phase: Phase | None = None
    oom: OomDetail | None = Field(
        default=None,
        description="Which allocation failed and what memory held then (the emulated GPU).",
    )
    # Live bytes after every op of a complete tracked step, for the search's per-op fit. It stays
    # in the process that measured it (and its parent, which unpickles it): never serialised.
    series: tuple[int, ...] | None = Field(default=None, exclude=True, repr=False)
    # The step's allocations and frees in order, encoded as autotune.core.memory.allocation_trace
    # reads them, for the search's replay through the allocator model; kept like `series`.
    allocations: tuple[int, ...] | None = Field(default=None, exclude=True, repr=False)
    # Where `allocations` started: the residents where the warm-up left them (None: packed into
    # a fresh allocator, as in the warm-up itself); kept like `allocations`.
    start: SkipValidation[TrialStart | None] = Field(default=None, exclude=True, repr=False)

    @classmethod
    def of_allocator(
        cls,
        micro_batch: int,
        stats: AllocatorStats,
        *,
        phase_peak_bytes: dict[Phase, int],
        oom_phase: Phase | None,
        oom: OomDetail | None,
        series: Sequence[int] | None,
        allocations: Sequence[int] | None,
        start: TrialStart | None = None,
    ) -> StepOutcome:
        """A step run through the model of the caching allocator, which never reserves past
        its capacity: it fits when nothing ran out, and only then keeps its `series` and
        `allocations` (None: not recorded)."""
        fits = oom_phase is None
        return cls(
            micro_batch=micro_batch,
            fits=fits,
            peak_bytes=stats.peak_reserved_bytes,
            peak_allocated_bytes=stats.peak_allocated_bytes,
            num_alloc_retries=stats.num_alloc_retries,
            phase_peak_bytes=phase_peak_bytes,
            oom_phase=oom_phase,
            oom=oom,
            series=tuple(series) if fits and series is not None else None,
            allocations=tuple(allocations) if fits and allocations is not None else None,
            start=start if fits and allocations is not None else None,
        )


def _none_is_empty(value: object) -> object:
    # Stored before revision 0009: null.
    return [] if value is None else value


# Micro-batch sizes a result lists (`runs_out_below`), read as empty where the store has null.
MicroBatches = Annotated[list[int], BeforeValidator(_none_is_empty)]


class TracedFit(FrozenModel):
    """The step traced without running it (fake tensors on a model of the probe's device)
    before the real trials: its fit points and the largest micro-batch they predicted. Next to
    the real attempts it shows the trace's error on that device."""

    predicted_max_micro_batch: int = Field(ge=0)
    fit_points: list[StepOutcome] = Field(max_length=8)


class AllocatorOption(FrozenModel):
    """The same mode under other caching-allocator settings (`allocator_conf`: the device's
    with `expandable_segments:True`): traced first, verified by a search of its own when the
    trace predicts a larger answer or no sizes running out where the device's settings have
    some."""

    allocator_conf: str = Field(max_length=ALLOCATOR_CONF_MAX)
    traced_max_micro_batch: int | None = Field(
        default=None, ge=0, description="The largest size the traced step predicts to fit."
    )
    max_micro_batch: int | None = Field(
        default=None, ge=0, description="Verified by trials; None: not run (no gain traced)."
    )
    recommended_micro_batch: int | None = Field(default=None, ge=0)
    runs_out_below: MicroBatches = Field(default_factory=list, max_length=4096)
    trials: int = Field(default=0, ge=0, description="Real trials the verification took.")
    accumulating_micro_batch: int | None = Field(
        default=None,
        ge=0,
        description="Largest micro-batch within the headroom under these settings when "
        "gradients accumulate; set by the tuner when it measures accumulating candidates under "
        "them (ModeProbe.accumulating_micro_batch's twin).",
    )
    recommended: bool = Field(
        default=False,
        description="The settings raise the mode's answer, or fit every size up to it where "
        "the device's settings leave some running out.",
    )


class ModeProbe(FrozenModel):
    """The search result for one checkpointing mode."""

    checkpointing: bool
    max_micro_batch: int = Field(ge=0, description="Exact largest micro-batch that fits.")
    recommended_micro_batch: int = Field(
        ge=0, description="Largest micro-batch whose peak leaves the spec's headroom free."
    )
    capped: bool = Field(description="True when max_micro_batch is the search cap.")
    attempts: list[StepOutcome]
    accumulating_micro_batch: int | None = Field(
        default=None,
        description="Largest micro-batch within the headroom when gradients accumulate over "
        "two or more micro-batches (earlier gradients stay alive); set by the tuner.",
    )
    traced: TracedFit | None = Field(
        default=None,
        description="The trace that gave the search its first fit, when the step was traced.",
    )
    runs_out_below: MicroBatches = Field(
        default_factory=list,
        max_length=4096,
        description="Micro-batches below max_micro_batch that run out (memory is not monotone "
        "in the micro-batch: the allocator's cache): seen in a trial, or predicted by the "
        "allocation replay that agreed with every trial. A short last batch of such a size "
        "runs out too.",
    )
    expandable_segments: AllocatorOption | None = Field(
        default=None,
        description="The mode under expandable segments, when evaluated (the device's "
        "settings do not have them, and the probe was given a session with them).",
    )


REMEDY_LABEL_MAX = 200  # characters of a remedy's description


class Remedy(FrozenModel):
    """One change to a spec that fits nowhere which makes it fit, verified by a traced trial of
    the changed spec on the same GPU (`autotune.engine.remedy_trials`)."""

    change: str = Field(max_length=REMEDY_LABEL_MAX, description="The change, for people.")
    spec_diff: dict[str, Any] = Field(
        max_length=8,
        description='The changed training fields and their new values, e.g. {"weights": "bf16"}.',
    )
    checkpointing: bool = Field(description="The mode the trial fitted in (plain tried first).")
    micro_batch: int = Field(ge=1, description="The micro-batch of the verifying trial.")
    seq_len: int | None = Field(default=None, ge=1, description="Tokens per sample.")
    world_size: int = Field(ge=1)
    peak_bytes: int = Field(ge=0, description="The verifying trial's peak, per GPU.")
    capacity_bytes: int = Field(ge=0, description="The capacity of one GPU for that spec.")
    samples_per_s: PositiveRate | None = Field(
        default=None,
        description="Estimated for the whole job (every GPU) at that micro-batch, without "
        "accumulation; None without a named GPU (no speed).",
    )
    samples_per_s_per_gpu: PositiveRate | None = None
    tokens_per_s: PositiveRate | None = Field(default=None, description="The whole job's.")


class FitAdvice(FrozenModel):
    """What would make a spec fit that fits in no checkpointing mode, even at micro-batch 1:
    the changes verified to fit, fastest first, and what was tried without success."""

    remedies: list[Remedy] = Field(max_length=32, description="Fastest (job samples/s) first.")
    still_too_large: list[Annotated[str, Field(max_length=REMEDY_LABEL_MAX)]] = Field(
        default_factory=list, max_length=32, description="Changes tried that do not fit alone."
    )
    not_modelled: list[Annotated[str, Field(max_length=ASSUMPTION_MAX)]] = Field(
        default_factory=list, max_length=8, description="Changes that would help, not modelled."
    )


class ProbeResult(FrozenModel):
    device: DeviceInfo
    modes: list[ModeProbe]
    fit_advice: FitAdvice | None = Field(
        default=None,
        description="When micro-batch 1 fits in no mode and the changes were looked for: what "
        "would make the spec fit.",
    )


class SequenceTrial(FrozenModel):
    """One step of the longest-sequence search: a sequence length and whether it fitted."""

    seq_len: int = Field(ge=1)
    fits: bool
    peak_bytes: int = Field(ge=0)


class SequenceModeProbe(FrozenModel):
    """The longest sequence that fits in one checkpointing mode."""

    checkpointing: bool
    max_seq_len: int = Field(ge=0, description="0: not even one step of tokens fits.")
    capped: bool = Field(description="True when max_seq_len is the longest tried (the cap).")
    attempts: list[SequenceTrial]


class SequenceProbeResult(FrozenModel):
    """`autotune probe --max-seq-len`: the longest sequence, a multiple of `step_tokens` up to
    `cap_tokens`, whose training step fits at `micro_batch`."""

    device: DeviceInfo
    micro_batch: int = Field(ge=1)
    step_tokens: int = Field(ge=1)
    cap_tokens: int = Field(ge=1)
    modes: list[SequenceModeProbe]


# ---------------------------------------------------------------------------------------------
# Tuning results.


class TrialState(StrEnum):
    COMPLETE = "complete"
    OOM = "oom"  # infeasible: recorded, not a crash
    FAILED = "failed"  # any other error (only the worker's child processes produce this)


def checkpointing_label(checkpointing: bool, blocks: int | None, total: int | None = None) -> str:
    """How a configuration checkpoints, for people: off, on, or on the first k (of L) blocks."""
    if not checkpointing:
        return "off"
    if blocks is None:
        return "on"
    return f"first {blocks}{f' of {total}' if total else ''} blocks"


class Trial(FrozenModel):
    """One throughput measurement of (micro_batch, accumulation_steps, checkpointing)."""

    number: int = Field(ge=0)
    micro_batch: int = Field(ge=1)
    accumulation_steps: int = Field(ge=1)
    checkpointing: bool
    checkpointed_blocks: int | None = Field(
        default=None,
        ge=1,
        description="With checkpointing, the first this many blocks only (partial "
        "checkpointing); None: every block.",
    )
    allocator_conf: str | None = Field(
        default=None,
        max_length=ALLOCATOR_CONF_MAX,
        description="PYTORCH_ALLOC_CONF the trial ran under when not the device's: its mode's "
        "expandable-segments settings (ModeProbe.expandable_segments), for a micro-batch that "
        "fits within the headroom only under them. None: the device's settings.",
    )
    state: TrialState
    samples_per_s: PositiveRate | None = None
    tokens_per_s: PositiveRate | None = None
    step_time_s: PositiveRate | None = Field(
        default=None, description="Median optimizer-step time."
    )
    step_time_spread: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="(max - min) / median of the timed steps.",
    )
    timed_steps: int = Field(default=0, ge=0)
    peak_bytes: int | None = Field(default=None, ge=0)
    compute_time_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Estimated with several ranks: the optimizer step's compute (roofline).",
    )
    communication_time_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Estimated with several ranks: all the step's collectives, hidden or not.",
    )
    exposed_communication_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="The part of communication_time_s no compute hides: step_time_s = "
        "compute_time_s + exposed_communication_s.",
    )
    error: str | None = None

    @property
    def checkpointing_label(self) -> str:
        return checkpointing_label(self.checkpointing, self.checkpointed_blocks)


class Recommendation(FrozenModel):
    micro_batch: int = Field(ge=1)
    accumulation_steps: int = Field(ge=1)
    checkpointing: bool
    checkpointed_blocks: int | None = Field(
        default=None,
        ge=1,
        description="With checkpointing, the first this many blocks only; None: every block.",
    )
    num_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Blocks the model has, when checkpointed_blocks is set.",
    )
    world_size: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    runs_out_below: MicroBatches = Field(
        default_factory=list,
        max_length=4096,
        description="Micro-batches below micro_batch that run out in its checkpointing mode "
        "(memory is not monotone in the micro-batch): every batch must keep micro_batch "
        "samples, a short last batch included.",
    )
    allocator_conf: str | None = Field(
        default=None,
        max_length=ALLOCATOR_CONF_MAX,
        description="PYTORCH_ALLOC_CONF the recommendation holds for when it is not the "
        "device's: expandable segments, where its trial ran under them (they fit a larger "
        "micro-batch) or where they fit every size up to micro_batch; every export sets it. "
        "None: the device's settings.",
    )

    samples_per_s: PositiveRate = Field(description="Per GPU (one rank's samples/s).")
    tokens_per_s: PositiveRate | None = Field(default=None, description="Per GPU.")
    peak_bytes: int = Field(ge=0)
    capacity_bytes: int = Field(ge=0)
    sharding: Sharding | None = Field(
        default=None,
        description="The layout it was measured with: the spec's, or with sharding: auto the "
        "one the tuner chose (None: recorded before layouts were chosen, the spec's).",
    )

    @property
    def checkpointing_label(self) -> str:
        return checkpointing_label(self.checkpointing, self.checkpointed_blocks, self.num_blocks)

    @property
    def job_samples_per_s(self) -> float:
        """The whole job's samples/s: every rank's."""
        return self.samples_per_s * self.world_size

    @property
    def job_tokens_per_s(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s * self.world_size

    def layout_training(self, training: TrainingSpec) -> TrainingSpec:
        """`training` as measured: with sharding: auto, the layout this recommendation names."""
        if training.sharding is Sharding.AUTO and self.sharding is not None:
            return training.with_layout(self.sharding)
        return training


class Infeasible(FrozenModel):
    """Why no configuration hits the target batch exactly, and what would."""

    reason: str
    nearest_below: int | None = Field(default=None, description="Largest achievable < target.")
    nearest_above: int | None = Field(default=None, description="Smallest achievable > target.")


class Exports(FrozenModel):
    """Ready-to-paste settings, with each ecosystem's own key names. A pure function of the
    recommendation, the spec's training section, `token_model` and `transformers_version`
    (`autotune.core.exports.build_exports`): the server rebuilds them from those, never storing
    a worker's text."""

    hf: dict[str, Any]
    axolotl: dict[str, Any]
    deepspeed: dict[str, Any]
    lightning: dict[str, Any]
    pytorch_loop: str
    lora: dict[str, Any] | None = Field(
        default=None,
        description="peft LoraConfig keyword arguments when the run trains LoRA adapters.",
    )
    checkpointed_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Partial checkpointing: the first this many blocks are checkpointed.",
    )
    num_blocks: int | None = Field(default=None, ge=1, description="Blocks the model has.")
    runs_out_below: MicroBatches = Field(
        default_factory=list,
        max_length=4096,
        description="Micro-batches below the exported one that run out: every text says to "
        "keep each batch at the exported size.",
    )
    allocator_conf: str | None = Field(
        default=None,
        max_length=ALLOCATOR_CONF_MAX,
        description="PYTORCH_ALLOC_CONF the exported run was measured with, which every text "
        "sets: the recommendation's allocator_conf, else the device's; None: torch's defaults.",
    )
    tokens_per_sample: int | None = Field(
        default=None,
        description="Set for a token target (training.target_global_tokens): the packed "
        "sample length the target was turned into samples with.",
    )
    training: TrainingSpec = Field(
        default_factory=TrainingSpec,
        description="The training section the settings were built for: what each text says "
        "its consumer holds beyond the measured run comes from it (exports stored before it "
        "was recorded read as the defaults).",
    )
    token_model: bool = Field(
        default=True, description="The loop normalises by label tokens (else by samples)."
    )
    transformers_version: str | None = Field(
        default=None,
        max_length=TRANSFORMERS_VERSION_MAX,
        pattern=r"^[0-9][0-9A-Za-z.+-]*$",
        description="The transformers version the Hugging Face settings were written for "
        "(its checkpointing key and FSDP version); None: unknown.",
    )


class LayoutVerdict(StrEnum):
    """How a layout fared when the tuner chose among them (sharding: auto)."""

    CHOSEN = "chosen"
    SLOWER = "slower"  # fits and hits the target, slower than the chosen one (or tied, simpler)
    MISSES_TARGET = "misses_target"  # fits, but no configuration hits the target batch
    DOES_NOT_FIT = "does_not_fit"  # micro-batch 1 runs out of memory in every mode


LAYOUT_REASON_MAX = 600


class LayoutOutcome(FrozenModel):
    """One layout the tuner measured for sharding: auto: how far each checkpointing mode goes,
    its best configuration's speed (compute and exposed communication) and memory per rank,
    and why it lost (or that it won)."""

    sharding: Sharding
    shard_group_size: int | None = Field(default=None, ge=2)
    verdict: LayoutVerdict
    reason: str = Field(max_length=LAYOUT_REASON_MAX)
    max_micro_batch: int = Field(ge=0, description="Largest micro-batch that fits, plain.")
    max_micro_batch_checkpointed: int | None = Field(
        default=None, ge=0, description="Largest checkpointed; None: not checkpointable."
    )
    recommendation: Recommendation | None = Field(
        default=None, description="Its best configuration (its samples/s per GPU)."
    )
    compute_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    communication_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    exposed_communication_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    trials: int = Field(default=0, ge=0, description="Configurations measured.")


# Layouts a result lists, read as empty where the store has null (runs without sharding: auto).
Layouts = Annotated[list[LayoutOutcome], BeforeValidator(_none_is_empty)]


class TuneResult(FrozenModel):
    spec: Spec
    device: DeviceInfo
    probe: ProbeResult
    trials: list[Trial]
    recommendation: Recommendation | None
    infeasible: Infeasible | None = None
    exports: Exports | None = None
    study_name: str | None = Field(default=None, max_length=STUDY_NAME_MAX)
    layouts: list[LayoutOutcome] = Field(
        default_factory=list,
        max_length=8,
        description="sharding: auto: every layout measured, the chosen one first; the probe, "
        "trials and recommendation are the chosen layout's (or, when none fits the target, "
        "the first listed).",
    )

    @property
    def measured_training(self) -> TrainingSpec:
        """The training section the probe and trials ran with: the spec's, or with sharding:
        auto the layout listed first (the chosen one)."""
        training = self.spec.training
        if training.sharding is Sharding.AUTO and self.layouts:
            return training.with_layout(self.layouts[0].sharding)
        return training
