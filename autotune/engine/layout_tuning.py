"""`sharding: auto`: tune every layout valid for the topology and recommend the fastest
(`autotune.core.parallel.layout_choice` says which are candidates, which wins and why the
others lost). Each layout is tuned as a spec of its own by `tuner.tune_session`, on a runner of
its own: a layout changes what each rank holds, so its model, device state and trials are its
own.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from autotune.core.exports import build_exports
from autotune.core.parallel.layout_choice import (
    LAYOUT_NAMES,
    LayoutRun,
    compare_layouts,
    layout_candidates,
)
from autotune.core.schemas import STUDY_NAME_MAX, Sharding, Spec, TuneResult
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.probe import AttemptCallback, FitTracer, PhaseCallback
from autotune.engine.runner import TrialRunner
from autotune.engine.tuner import TrialCallback, checked_result, tune_session

# A layout's runner, and the probe's tracer for it (None: none).
LayoutRunner = Callable[[Spec], tuple[TrialRunner, FitTracer | None]]
LayoutCallback = Callable[[Sharding, int, int], None]


def layout_spec(spec: Spec, sharding: Sharding) -> Spec:
    """`spec` with `sharding` as its layout (hybrid: the node is the shard group)."""
    return spec.model_copy(update={"training": spec.training.with_layout(sharding)})


@with_few_full_collections
def tune_layouts(
    spec: Spec,
    open_layout: LayoutRunner,
    *,
    storage_url: str,
    study_name: str | None = None,
    n_trials: int | None = None,
    seed: int = 0,
    target_seconds: float = 1.0,
    on_attempt: AttemptCallback | None = None,
    on_trial: TrialCallback | None = None,
    on_phase: PhaseCallback | None = None,
    on_layout: LayoutCallback | None = None,
) -> TuneResult:
    """Tune `spec` (sharding: auto) once per candidate layout and answer with the chosen one:
    its probe, trials, recommendation (naming the layout) and exports, and every layout's
    outcome in `layouts`. `open_layout` opens the runner of one layout's spec.

    Raises:
        SpecError: the spec has no `training.target_global_batch`.
        AssertionError: the result breaks an invariant of `autotune.core.result_check`.
    """
    if spec.training.sharding is not Sharding.AUTO:
        raise ValueError(f"tune_layouts is for sharding: auto, not {spec.training.sharding}")
    spec.training.required_target_global_batch()
    study_name = study_name or f"autotune-{uuid.uuid4().hex[:12]}"
    layouts = layout_candidates(spec.training)
    runs: list[LayoutRun] = []
    for index, sharding in enumerate(layouts):
        if on_layout is not None:
            on_layout(sharding, index, len(layouts))
        if on_phase is not None:
            on_phase(f"layout {index + 1} of {len(layouts)}: {LAYOUT_NAMES[sharding]}", None)
        runner, tracer = open_layout(layout_spec(spec, sharding))
        result = tune_session(
            runner,
            storage_url=storage_url,
            study_name=f"{study_name}-{sharding.value}"[:STUDY_NAME_MAX],
            n_trials=n_trials,
            seed=seed,
            target_seconds=target_seconds,
            on_attempt=on_attempt,
            on_trial=on_trial,
            tracer=tracer,
            on_phase=on_phase,
        )
        runs.append(LayoutRun(sharding, result))
    shown, outcomes = compare_layouts(runs)
    chosen = shown.result
    recommendation = chosen.recommendation
    exports = None
    if recommendation is not None and chosen.exports is not None:
        exports = build_exports(
            recommendation,
            token_model=chosen.exports.token_model,
            transformers_version=chosen.exports.transformers_version,
            training=spec.training,
            device_allocator_conf=chosen.device.allocator_conf,
        )
    return checked_result(
        chosen.model_copy(update={"spec": spec, "exports": exports, "layouts": outcomes})
    )


__all__ = ["LayoutCallback", "LayoutRunner", "layout_spec", "tune_layouts"]
