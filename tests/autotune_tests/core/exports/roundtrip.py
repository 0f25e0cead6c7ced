"""The round trip of an export: what run a consumer builds from it, read back as plain
properties and compared with the run the engine measures for the same spec.

Every run here trains the same tiny transformers Llama (`TINY_LLAMA_CONFIG`) on token batches.
`observe` hooks a model (and its optimizer) before one optimizer step and reads back:

* micro_batch and accumulation: the batch size the model's forward sees, and how many forwards
  one optimizer step runs;
* autocast: the dtype the forward runs under (None: no autocast); grad_scaler;
* weights, trainable, grads: the dtypes of the frozen parameters, of the trained ones and of
  their gradients (at the optimizer step);
* trainable_params: how many parameters train (the LoRA adapters' count under LoRA);
* optimizer and state_bytes: the optimizer's class and its state's bytes per trained element;
* checkpointed: which decoder layers run their MLP twice (recomputed in backward);
* sharding: DDP (with gradient_as_bucket_view or not), ZeRO-1 (ZeroRedundancyOptimizer), or
  FSDP2 (its mesh's shape and whether blocks reshard after forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autotune.core.schemas import Recommendation, TrainingSpec
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

SEQ_LEN = 16
VOCAB = TINY_LLAMA_CONFIG["vocab_size"]
DECODER_LAYER = "LlamaDecoderLayer"


@dataclass(frozen=True)
class Case:
    """One spec kind: its training section and the recommendation that was measured."""

    training: dict[str, Any]
    micro_batch: int = 2
    accumulation: int = 2
    checkpointing: bool = False
    checkpointed_blocks: int | None = None

    def spec(self) -> TrainingSpec:
        return TrainingSpec(seq_len=SEQ_LEN, **self.training)

    def recommendation(self) -> Recommendation:
        world = self.spec().world_size
        return Recommendation(
            micro_batch=self.micro_batch,
            accumulation_steps=self.accumulation,
            checkpointing=self.checkpointing,
            checkpointed_blocks=self.checkpointed_blocks,
            num_blocks=TINY_LLAMA_CONFIG["num_hidden_layers"]
            if self.checkpointed_blocks
            else None,
            world_size=world,
            global_batch=self.micro_batch * self.accumulation * world,
            samples_per_s=1.0,
            peak_bytes=1,
            capacity_bytes=2,
        )


_LORA = {"r": 4, "alpha": 8.0}
CASES: dict[str, Case] = {
    "fp32": Case({}),
    "bf16-autocast": Case({"precision": "bf16"}),
    "fp16": Case({"precision": "fp16"}),
    "bf16-weights": Case({"precision": "bf16", "weights": "bf16"}),
    "lora": Case({"lora": _LORA}),
    "lora-modules-to-save": Case(
        {"lora": {**_LORA, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}}
    ),
    "adamw8bit": Case({"optimizer": "adamw8bit"}),
    # torchao's AdamW8bit on FSDP2's shards (bitsandbytes' does not support them).
    "adamw8bit-zero3": Case({"optimizer": "adamw8bit", "world_size": 2, "sharding": "zero3"}),
    "sgd": Case({"optimizer": "sgd"}),
    "adafactor": Case({"optimizer": "adafactor"}),
    "ddp": Case({"world_size": 2}),
    "zero1": Case({"world_size": 2, "sharding": "zero1"}),
    "zero2": Case({"world_size": 2, "sharding": "zero2"}),
    "zero3": Case({"world_size": 2, "sharding": "zero3"}),
    "zero3-bf16": Case({"precision": "bf16", "world_size": 2, "sharding": "zero3"}),
    "hybrid": Case({"world_size": 4, "sharding": "hybrid", "shard_group_size": 2}),
    "token-target": Case({"target_global_tokens": 2 * 2 * SEQ_LEN}),
    "partial-checkpointing": Case({}, checkpointing=True, checkpointed_blocks=1),
    "combination": Case(
        {"precision": "bf16", "lora": _LORA, "world_size": 2, "target_global_tokens": 8 * SEQ_LEN},
        checkpointing=True,
        checkpointed_blocks=1,
    ),
}


def tiny_llama() -> nn.Module:
    """The model every run trains, with the same weights each time."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**TINY_LLAMA_CONFIG)
    config.use_cache = False
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa"
    )
    return model


def token_batch(micro_batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


@dataclass
class Observation:
    """What hooks saw during one optimizer step; `properties` reads it back."""

    batch_sizes: list[int] = field(default_factory=list)
    autocast: list[str | None] = field(default_factory=list)
    layer_calls: list[int] = field(default_factory=list)
    trainable: set[str] = field(default_factory=set)
    grads: set[str] = field(default_factory=set)
    steps: int = 0


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(DECODER_LAYER)]


def root_model(model: nn.Module) -> nn.Module:
    """The transformers model inside wrappers (DDP, peft, Lightning modules)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("LlamaForCausalLM")]
    assert found, "no LlamaForCausalLM in the run's model"
    return found[0]


@contextlib.contextmanager
def observe(model: nn.Module, local_optimizer: torch.optim.Optimizer) -> Iterator[Observation]:
    """Hooks on `model`'s forward, its decoder layers and `local_optimizer`'s step."""
    seen = Observation()
    layers = decoder_layers(model)
    seen.layer_calls = [0] * len(layers)

    def on_forward(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        assert isinstance(ids, torch.Tensor)
        seen.batch_sizes.append(int(ids.shape[0]))

    def counter(index: int) -> Callable[..., None]:
        def on_layer(*_: Any) -> None:
            seen.layer_calls[index] += 1
            if index == 0 and torch.is_grad_enabled():
                # Inside the forward: a wrapper may start autocast there (accelerate does).
                enabled = torch.is_autocast_enabled("cpu")
                dtype = torch.get_autocast_dtype("cpu")
                seen.autocast.append(str(dtype).removeprefix("torch.") if enabled else None)

        return on_layer

    def on_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        seen.steps += 1
        for group in optimizer.param_groups:
            for param in group["params"]:
                seen.trainable.add(_dtype(param))
                if param.grad is not None:
                    seen.grads.add(_dtype(param.grad))

    handles = [root_model(model).register_forward_pre_hook(on_forward, with_kwargs=True)]
    # On a submodule: transformers checkpoints a layer's forward, inside its hooks, so only what
    # the forward calls runs again in backward.
    handles += [layer.mlp.register_forward_pre_hook(counter(i)) for i, layer in enumerate(layers)]
    handles.append(local_optimizer.register_step_pre_hook(on_step))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _storages(tensor: torch.Tensor) -> dict[int, int]:
    """The storages (address: bytes) a tensor holds, through tensor subclasses such as
    torchao's 8-bit states (codes, scales, a quantisation map)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) is torch.Tensor:
        storage = tensor.untyped_storage()
        return {storage.data_ptr(): storage.nbytes()}
    found: dict[int, int] = {}
    for name in flatten()[0]:
        found.update(_storages(_local(getattr(tensor, name))))
    return found


def state_bytes_per_element(optimizer: torch.optim.Optimizer, model: nn.Module) -> float:
    """The optimizer state's bytes (each storage once, scalars left out) per trained element."""
    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                storages.update(_storages(_local(value)))
    elements = sum(_local(p).numel() for p in model.parameters() if p.requires_grad)
    return round(sum(storages.values()) / elements, 1)


def sharding_of(model: nn.Module, optimizer: object, *, ddp_bucket_view: bool | None) -> str:
    """How the run shares its state across ranks (see the module docstring)."""
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return f"zero1 over {dist.get_world_size()}"
    blocks = decoder_layers(model)
    sharded = [p for p in blocks[0].parameters() if type(p).__name__ == "DTensor"]
    if sharded:
        mesh = tuple(sharded[0].device_mesh.shape)
        group = blocks[0]._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        reshard = group.post_forward_mesh_info is not None
        return f"fsdp2 mesh {mesh} reshard_after_forward={reshard}"
    if ddp_bucket_view is not None:
        return f"ddp gradient_as_bucket_view={ddp_bucket_view}"
    return "none"


def gathers_of(model: nn.Module) -> str:
    """What FSDP2's ranks gather parameters and reduce gradients in (its mixed-precision
    policy): 16-bit gathers and fp32 reductions under autocast of fp32 weights."""
    blocks = decoder_layers(model)
    if not any(type(p).__name__ == "DTensor" for p in blocks[0].parameters()):
        return "not sharded"
    policy = blocks[0]._get_fsdp_state()._fsdp_param_group.mp_policy  # type: ignore[operator]
    return f"param_dtype={policy.param_dtype} reduce_dtype={policy.reduce_dtype}"


def properties(
    seen: Observation,
    model: nn.Module,
    local_optimizer: torch.optim.Optimizer,
    *,
    world_size: int,
    grad_scaler: bool,
    sharding: str,
) -> dict[str, Any]:
    """The run's properties once one optimizer step ran under `observe`."""
    assert seen.steps == 1, f"{seen.steps} optimizer steps"
    forwards = len(seen.batch_sizes)
    frozen = {_dtype(p) for p in model.parameters() if not p.requires_grad}
    return {
        "gathers": gathers_of(model),
        "micro_batch": seen.batch_sizes[0],
        "accumulation": forwards,
        "world_size": world_size,
        "autocast": seen.autocast[0],
        "grad_scaler": grad_scaler,
        "weights": sorted(frozen or seen.trainable),
        "trainable": sorted(seen.trainable),
        "grads": sorted(seen.grads),
        # A DTensor's numel is the whole parameter's.
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer": type(local_optimizer).__name__,
        "state_bytes": state_bytes_per_element(local_optimizer, model),
        "checkpointed": [i for i, calls in enumerate(seen.layer_calls) if calls > forwards],
        "sharding": sharding,
    }


def fake_ranks(world_size: int) -> None:
    """A fake process group of `world_size` ranks (this process is rank 0), as the engine
    measures sharded runs; none for one rank."""
    from autotune.engine.training.sharding import process_group

    if world_size > 1:
        process_group(world_size)
    elif dist.is_initialized():
        dist.destroy_process_group()


def leave_fake_ranks() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def measured(case: Case) -> dict[str, Any]:
    """The properties of the run the engine measures for `case`."""
    from autotune.engine.training.step import TrainingStep
    from autotune.engine.training.workload import build_hf_config

    training = case.spec()
    torch.manual_seed(0)
    workload = build_hf_config(dict(TINY_LLAMA_CONFIG), training)
    step = TrainingStep(workload, training, torch.device("cpu"))
    try:
        step.checkpointing = case.checkpointing
        if case.checkpointing:
            step.checkpoint_blocks(case.checkpointed_blocks)
        local = getattr(step.optimizer, "optim", step.optimizer)
        with observe(step.model, local) as seen:
            step.run(case.micro_batch, case.accumulation)
        return properties(
            seen,
            step.model,
            local,
            world_size=training.world_size,
            grad_scaler=step.scaler is not None,
            sharding=sharding_of(
                step.model, step.optimizer, ddp_bucket_view=True if step.reducer else None
            ),
        )
    finally:
        leave_fake_ranks()
