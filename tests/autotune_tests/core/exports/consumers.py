"""Each consumer builds its run from an export, as pasted, with the real library; the
properties of that run (`roundtrip.properties`) or, where this CPU-only machine stops the
library short of running it, the same properties read from the objects it builds.

Depths: the plain loop runs one step (sharded runs over a fake process group, as the engine
measures them); Hugging Face runs `Trainer.train()` for one step on one rank, reads its
DeepSpeed config for ZeRO-1, and for FSDP2 builds the Trainer on the run's (fake) ranks and
shards the model with accelerate's own `fsdp2_prepare_model` (accelerate's FSDP state itself
needs a GPU: `accelerate_fsdp2` says what it stands in for);
Lightning runs one step with the module's `configure_model`/`configure_optimizers` as pasted,
the Trainer's precision plugin and accumulation, and reads the strategy objects; DeepSpeed reads
`DeepSpeedConfig`; Axolotl validates with its own `validate_config`, builds the optimizer
class and the LoRA adapters the way its trainer builds them, and shards the model under FSDP2
with its own `fsdp2_prepare_model`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autotune.core.exports import render_exports
from autotune.core.schemas import Exports
from tests.autotune_tests.core.exports.roundtrip import (
    Case,
    fake_ranks,
    gathers_of,
    leave_fake_ranks,
    observe,
    properties,
    sharding_of,
    tiny_llama,
    token_batch,
)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------
# The plain PyTorch loop, executed.


def _no_transfer(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce over the fake process group, which moves nothing: the bucket as it is
    (the fake group's own all-reduce returns no tensor, which DDP asserts on)."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


# DDP checks the annotations as objects; this module's are strings (postponed evaluation).
_no_transfer.__annotations__ = {
    "_": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def loop_run(exports: Exports, case: Case) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "autotune_loop"}
    exec(compile(exports.pytorch_loop, "<pytorch_loop>", "exec"), namespace)
    world = case.spec().world_size
    fake_ranks(world)
    try:
        model = namespace["prepare_model"](tiny_llama())
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, _no_transfer)
        optimizer = namespace["make_optimizer"](model, lr=1e-3)
        scaler = namespace["make_scaler"](model)
        local = getattr(optimizer, "optim", optimizer)
        batches = [token_batch(namespace["MICRO_BATCH"]) for _ in range(case.accumulation)]
        with observe(model, local) as seen:
            namespace["train_step"](model, optimizer, batches, scaler)
        bucket_view = getattr(model, "gradient_as_bucket_view", None)
        return properties(
            seen,
            model,
            local,
            world_size=namespace["WORLD_SIZE"],
            grad_scaler=scaler is not None,
            sharding=sharding_of(model, optimizer, ddp_bucket_view=bucket_view),
        )
    finally:
        leave_fake_ranks()


# ---------------------------------------------------------------------------------------------
# Hugging Face: the rendered text executed (your other arguments filled in), then the Trainer.

_OTHER_ARGUMENTS = "    # ... your other arguments\n"


def hf_objects(exports: Exports, tmp: str) -> dict[str, Any]:
    """The pasted text run with `model` the tiny Llama: its `args` and `model`."""
    text = render_exports(exports)["hf"]
    assert text.count(_OTHER_ARGUMENTS) == 1
    text = text.replace(
        _OTHER_ARGUMENTS,
        f"    output_dir={tmp!r}, use_cpu=True, max_steps=1, report_to=[],\n"
        "    save_strategy='no', logging_strategy='no', remove_unused_columns=False,\n",
    )
    namespace: dict[str, Any] = {"model": tiny_llama()}
    exec(compile(text, "<hf>", "exec"), namespace)
    return namespace


def hf_run(exports: Exports, case: Case, tmp: str) -> dict[str, Any]:
    """One optimizer step of the Trainer on one rank."""
    from transformers import Trainer

    namespace = hf_objects(exports, tmp)
    args, model = namespace["args"], namespace["model"]
    dataset = [token_batch(1) for _ in range(args.per_device_train_batch_size * 4)]
    rows = [{key: value[0] for key, value in row.items()} for row in dataset]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        optimizer_cls_and_kwargs=namespace.get("optimizer_cls_and_kwargs"),
    )
    optimizer = trainer.create_optimizer()
    with observe(model, optimizer) as seen:
        trainer.train()
    accelerator = trainer.accelerator
    return properties(
        seen,
        model,
        optimizer,
        world_size=args.world_size,
        grad_scaler=accelerator.scaler is not None,
        sharding="none",
    )


def hf_sharding(exports: Exports, case: Case, tmp: str) -> dict[str, Any]:
    """What the Trainer's arguments set up on several ranks: the DeepSpeed config (ZeRO-1), or
    the model as accelerate's FSDP2 shards it for the Trainer (its mesh and mixed precision)."""
    world = case.spec().world_size
    found: dict[str, Any] = {}
    if "deepspeed" in exports.hf:
        args = hf_objects(exports, tmp)["args"]
        found.update(deepspeed_properties(args.deepspeed, world))
    else:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        with launched(world):
            namespace = hf_objects(exports, tmp)
            args = namespace["args"]
            model = accelerate_fsdp2(args, namespace["model"], fsdp2_prepare_model)
            found["sharding"] = sharding_of(model, None, ddp_bucket_view=None)
            found["gathers"] = gathers_of(model)
    batch = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {"micro_batch": batch[0], "accumulation": batch[1], **found}


@contextlib.contextmanager
def launched(world_size: int) -> Iterator[None]:
    """This process as rank 0 of `world_size` ranks launched by torchrun: a fake process group
    and torchrun's environment, both undone after (with accelerate's shared state)."""
    from accelerate.state import AcceleratorState

    saved = dict(os.environ)
    fake_ranks(world_size)
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK="0",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        leave_fake_ranks()
        os.environ.clear()
        os.environ.update(saved)


def accelerate_fsdp2(
    args: Any, model: nn.Module, prepare: Callable[[Any, nn.Module], nn.Module]
) -> nn.Module:
    """`model` sharded by `prepare` (accelerate's `fsdp2_prepare_model`, or Axolotl's patch of
    it) for the Trainer built from `args`, under `launched`.

    The Trainer builds its accelerator and FSDP plugin from `args.fsdp_plugin_args` here as on a
    GPU box, but accelerate keeps the plugin and the device mesh only for GPU ranks: on this
    CPU's ranks this does what `AcceleratorState` and `Accelerator` do there, with accelerate's
    own calls: `set_mixed_precision` of the Trainer's precision on the plugin, and the device
    mesh of `args.parallelism_config` (which `Accelerator` refuses on CPU ranks)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer

    parallelism, args.parallelism_config = args.parallelism_config, None
    accelerator = Trainer(model=model, args=args).accelerator
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    assert plugin.fsdp_version == 2
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    if parallelism is not None:
        accelerator.state.parallelism_config = parallelism
        accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
    return prepare(accelerator, model)


# ---------------------------------------------------------------------------------------------
# Lightning: the module's methods as pasted, the Trainer's precision plugin and accumulation.


def _uncommented(text: str, start: str) -> str:
    """The commented code block of `text` from the line `# {start}` on, uncommented."""
    lines = text.splitlines()
    first = lines.index(f"# {start}")
    block = [line.removeprefix("# ") for line in lines[first:] if line.startswith("# ")]
    return "\n".join(line if line != "#" else "" for line in block) + "\n"


class _Module(nn.Module):
    """A LightningModule's state as configure_model and configure_optimizers see it."""

    def __init__(self, model: nn.Module, mesh: Any) -> None:
        super().__init__()
        self.model = model
        self.device_mesh = {"data_parallel": mesh}


def lightning_run(exports: Exports, case: Case) -> dict[str, Any]:
    import lightning as L

    text = render_exports(exports)["lightning"]
    arguments = exports.lightning
    world = case.spec().world_size
    methods: dict[str, Any] = {"torch": torch}
    # The user's device (this machine's CPU) and learning rate.
    code = _uncommented(text, "def configure_model(self):")
    exec(code.replace('"cuda"', '"cpu"').replace("lr=...", "lr=1e-3"), methods)
    trainer = L.Trainer(
        **arguments["trainer"], accelerator="cpu", devices=1, logger=False, max_steps=1
    )
    strategy = _lightning_strategy(arguments)
    fake_ranks(world)
    try:
        mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        module = _Module(tiny_llama(), mesh)
        methods["configure_model"](module)
        optimizer = methods["configure_optimizers"](module)
        local = getattr(optimizer, "optim", optimizer)
        plugin = trainer.precision_plugin
        if arguments["trainer"]["precision"] == "16-mixed":
            # On a CPU accelerator Lightning swaps 16-mixed for bf16-mixed; its plugin for a
            # GPU (fp16 autocast, a GradScaler) runs on the CPU as well.
            from lightning.pytorch.plugins.precision import MixedPrecision

            plugin = MixedPrecision("16-mixed", device="cpu")
        scaler = getattr(plugin, "scaler", None)
        micro_batch = arguments["datamodule"]["batch_size"]
        with observe(module, local) as seen:
            for _ in range(trainer.accumulate_grad_batches):
                with plugin.forward_context():
                    loss = module.model(**token_batch(micro_batch)).loss
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        return properties(
            seen,
            module,
            local,
            world_size=world,
            grad_scaler=scaler is not None,
            sharding=sharding_of(module, optimizer, ddp_bucket_view=strategy),
        )
    finally:
        leave_fake_ranks()


def _lightning_strategy(arguments: dict[str, Any]) -> bool | None:
    """The DDP strategy's gradient_as_bucket_view as Lightning's DDPStrategy holds it (None:
    no DDP); ModelParallelStrategy's sizes checked against the run's."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if "ddp_strategy" in arguments:
        ddp = DDPStrategy(**arguments["ddp_strategy"])
        return bool(ddp._ddp_kwargs["gradient_as_bucket_view"])
    if "model_parallel_strategy" in arguments:
        sizes = arguments["model_parallel_strategy"]
        parallel = ModelParallelStrategy(**sizes)
        assert parallel._data_parallel_size == sizes["data_parallel_size"]
        assert parallel._tensor_parallel_size == 1
    return None


# ---------------------------------------------------------------------------------------------
# DeepSpeed: its own config object, on the run's ranks (a fake process group).


class _TorchRanks:
    """DeepSpeed's communication backend reduced to what its config parser asks: the rank and
    world size of torch's (fake) process group. DeepSpeed's own backend would build its
    shared-memory C++ op first (a compiler run on a fresh machine)."""

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def get_rank(self, group: Any = None) -> int:
        return dist.get_rank(group)

    def get_world_size(self, group: Any = None) -> int:
        return dist.get_world_size(group)


def deepspeed_properties(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What DeepSpeed 0.19's config parser makes of `config` on `world_size` ranks, and the
    optimizer class its engine builds from it (`_configure_basic_optimizer`)."""
    import deepspeed.comm.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    from autotune.engine.training.sharding import process_group

    process_group(world_size)
    backend, deepspeed.comm.comm.cdb = deepspeed.comm.comm.cdb, _TorchRanks()
    try:
        parsed = DeepSpeedConfig(json.loads(json.dumps(config)))
    finally:
        deepspeed.comm.comm.cdb = backend
        leave_fake_ranks()
    autocast = None
    if parsed.torch_autocast_enabled:
        autocast = str(parsed.torch_autocast_dtype).removeprefix("torch.")
    name, params = parsed.optimizer_name, parsed.optimizer_params or {}
    optimizer = None
    if name == "adamw" and params.get("torch_adam"):
        optimizer = "AdamW"  # torch.optim.AdamW
    elif name is not None:
        optimizer = getattr(torch.optim, name).__name__
    return {
        "micro_batch": parsed.train_micro_batch_size_per_gpu,
        "accumulation": parsed.gradient_accumulation_steps,
        "world_size": parsed.world_size,
        "autocast": autocast,
        "grad_scaler": autocast == "float16",
        "weights": ["bfloat16" if parsed.bfloat16_config.enabled else "float32"],
        "optimizer": optimizer,
        "optimizer_params": {k: v for k, v in params.items() if k != "torch_adam"},
        "zero_stage": parsed.zero_optimization_stage,
        "untested_optimizer_allowed": parsed.zero_allow_untested_optimizer,
    }


# ---------------------------------------------------------------------------------------------
# Axolotl: its own schema, then the optimizer class and adapters as its trainer builds them.


AXOLOTL_REQUIRED = {
    "base_model": "HuggingFaceTB/SmolLM2-135M",
    "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
    "learning_rate": 1e-4,
    "num_epochs": 1,
}


def axolotl_run(exports: Exports, case: Case, tmp: str) -> dict[str, Any]:
    import yaml
    from axolotl.utils.config import resolve_dtype, validate_config
    from axolotl.utils.dict import DictDefault
    from transformers import Trainer, TrainingArguments

    pasted = yaml.safe_load(render_exports(exports)["axolotl"])
    cfg = validate_config(DictDefault({**AXOLOTL_REQUIRED, **pasted}))
    resolve_dtype(cfg)
    args = TrainingArguments(
        output_dir=tmp,
        use_cpu=True,
        optim=cfg.optimizer,
        optim_args=",".join(f"{k}={v}" for k, v in (cfg.optim_args or {}).items()) or None,
    )
    optimizer_class, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    found: dict[str, Any] = {
        "micro_batch": cfg.micro_batch_size,
        "accumulation": cfg.gradient_accumulation_steps,
        "weights": [str(cfg.torch_dtype).removeprefix("torch.")],
        "autocast": "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else None,
        "optimizer": optimizer_class.__name__,
        "optimizer_momentum": optimizer_kwargs.get("momentum"),
        "checkpointing": bool(cfg.gradient_checkpointing),
    }
    if cfg.adapter == "lora":
        from axolotl.loaders.adapter import _build_peft_lora_config
        from peft import get_peft_model

        model = tiny_llama()
        lora = _build_peft_lora_config(model, cfg)
        found["trainable_params"] = _trainable(get_peft_model(model, lora))
        found["lora_alpha"] = cfg.lora_alpha
    if cfg.fsdp_version:
        mesh = (
            (cfg.dp_replicate_size, cfg.dp_shard_size)
            if cfg.dp_shard_size
            else (case.spec().world_size,)
        )
        reshard = cfg.fsdp_config.reshard_after_forward
        found["sharding"] = f"fsdp2 mesh {mesh} reshard_after_forward={reshard}"
        found["gathers"] = _axolotl_gathers(cfg, case, tmp)
    if cfg.deepspeed:
        found["zero_stage"] = cfg.deepspeed["zero_optimization"]["stage"]
    if cfg.sample_packing:
        found["tokens_per_sample"] = cfg.sequence_len
    return found


def _axolotl_gathers(cfg: Any, case: Case, tmp: str) -> str:
    """What Axolotl's FSDP2 gathers and reduces in: the model loaded in its dtype, sharded by
    Axolotl's own `fsdp2_prepare_model` for the Trainer arguments its builder passes (`bf16`,
    `fp16`, `fsdp`, `fsdp_config`: `axolotl/core/builders`)."""
    from axolotl.monkeypatch.accelerate.fsdp2 import fsdp2_prepare_model
    from transformers import TrainingArguments

    with launched(case.spec().world_size):
        args = TrainingArguments(
            output_dir=tmp,
            use_cpu=True,
            bf16=bool(cfg.bf16),
            fp16=bool(cfg.fp16),
            fsdp=True,
            fsdp_config=dict(cfg.fsdp_config),
        )
        model = tiny_llama().to(cfg.torch_dtype)
        return gathers_of(accelerate_fsdp2(args, model, fsdp2_prepare_model))
