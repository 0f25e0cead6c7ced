"""The DeepSpeed JSON run by DeepSpeed's own engine on two gloo ranks: `deepspeed.initialize`
builds from it the ZeRO stage, ranks, optimizer class, autocast and micro-batch that were
measured, and one optimizer step over the accumulation steps runs.

End-to-end (`make e2e`): DeepSpeed's CPU backend compiles its shared-memory op on first use (a
compiler run on a fresh machine), and two ranks import DeepSpeed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import spawn

from tests.autotune_tests.core.exports.roundtrip import (
    CASES,
    Case,
    decoder_layers,
    measured,
    tiny_llama,
    token_batch,
)
from tests.autotune_tests.core.exports.test_export_roundtrip import CANNOT_EXPRESS
from tests.autotune_tests.gloo import run_gloo_rank

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("deepspeed_engine")]


def _engine_rank(rank: int, workdir: str, config: dict[str, Any]) -> None:
    import deepspeed

    # What torchrun would set; the gloo group itself is run_gloo_rank's.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=config)
    autocast: list[str | None] = []

    def on_mlp(*_: Any) -> None:
        enabled = torch.is_autocast_enabled("cpu")
        dtype = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
        autocast.append(dtype if enabled else None)

    decoder_layers(engine.module)[0].mlp.register_forward_pre_hook(on_mlp)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(**token_batch(micro_batch)).loss
        engine.backward(loss)
        engine.step()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if engine.zero_optimization_stage() == 3:
        gathers = _zero3_gathers(engine)
    found = {
        "zero_stage": engine.zero_optimization_stage(),
        "world_size": engine.dp_world_size,
        "micro_batch": micro_batch,
        "optimizer": type(inner).__name__,
        "autocast": autocast[0],
        "global_steps": engine.global_steps,
    }
    if engine.zero_optimization_stage() == 3:
        found["gathers"] = gathers
    del engine, inner
    if rank == 0:
        Path(workdir, "found.json").write_text(json.dumps(found))


def _zero3_gathers(engine: Any) -> dict[str, str]:
    """The dtypes ZeRO-3 gathers each of the first block's parameters in and reduces their
    gradients in, by DeepSpeed's own choice (`get_allgather_dtype` and the optimizer's
    `get_param_comm_dtype`), as `roundtrip.gathers_of` words them, per kind of module."""
    from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype

    kinds: dict[str, set[str]] = {}
    for module in decoder_layers(engine.module)[0].modules():
        for param in module.parameters(recurse=False):
            gather = get_allgather_dtype(param, param.ds_tensor)
            reduce = engine.optimizer.get_param_comm_dtype(param)
            kind = kinds.setdefault(type(module).__name__, set())
            kind.add(f"param_dtype={gather} reduce_dtype={reduce}")
    return {kind: " / ".join(sorted(words)) for kind, words in kinds.items()}


@pytest.mark.parametrize(("name", "stage"), [("zero3", 3), ("zero1", 1)])
def test_deepspeeds_engine_builds_the_measured_run(name: str, stage: int, tmp_path: Path) -> None:
    from autotune.core.exports import build_exports, render_exports

    # What broke: bf16 ran in fp32 and SGD in AdamW (ZeRO runs SGD only when allowed).
    case = Case({**CASES[name].training, "precision": "bf16", "optimizer": "sgd"})
    exports = build_exports(
        case.recommendation(), token_model=True, transformers_version=None, training=case.spec()
    )
    spawn(  # type: ignore[no-untyped-call]
        run_gloo_rank, args=(_engine_rank, str(tmp_path), exports.deepspeed), nprocs=2, join=True
    )
    found = json.loads((tmp_path / "found.json").read_text())
    run = measured(case)
    if stage == 3:
        # torch_autocast: the Linear weights gathered and reduced in bf16 (what the notes say
        # cannot be expressed), the norms' in fp32.
        differs, words = CANNOT_EXPRESS[("deepspeed", "zero3-bf16")]
        assert words in render_exports(exports)["deepspeed_notes"]
        assert found.pop("gathers") == {
            "Linear": differs["gathers"],
            "LlamaRMSNorm": "param_dtype=torch.float32 reduce_dtype=torch.float32",
        }
        assert run["gathers"] == "param_dtype=torch.bfloat16 reduce_dtype=torch.float32"
    assert found == {
        "zero_stage": stage,
        "world_size": run["world_size"],
        "micro_batch": run["micro_batch"],
        "optimizer": run["optimizer"],
        "autocast": run["autocast"],
        "global_steps": 1,
    }
    assert (run["optimizer"], run["autocast"]) == ("SGD", "bfloat16")
