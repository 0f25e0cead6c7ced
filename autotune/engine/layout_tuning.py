"""`sharding: auto`: tune every layout valid for the topology and recommend the fastest
(`autotune.core.parallel.layout_choice` says which are candidates, which wins and why the
others lost). Each layout is tuned as a spec of its own by `tuner.tune_session`, on a runner of
its own: a layout changes what each rank holds, so its model, device state and trials are its
own. An estimate's layouts may be tuned side by side, in child processes
(`autotune.engine.layout_processes`).
"""

from __future__ import annotations

import uuid

from autotune.core.exports import build_exports
from autotune.core.parallel.layout_choice import (
    LAYOUT_NAMES,
    LayoutRun,
    compare_layouts,
    layout_candidates,
)
from autotune.core.schemas import STUDY_NAME_MAX, Sharding, Spec, TuneResult
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.layout_processes import (
    LayoutCallback,
    LayoutJob,
    LayoutRunner,
    TuneOptions,
    tune_job,
    tune_side_by_side,
)
from autotune.engine.probe import AttemptCallback, PhaseCallback
from autotune.engine.study import create_storage
from autotune.engine.tuner import TrialCallback, checked_result


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
    processes: int = 1,
) -> TuneResult:
    """Tune `spec` (sharding: auto) once per candidate layout and answer with the chosen one:
    its probe, trials, recommendation (naming the layout) and exports, and every layout's
    outcome in `layouts`. `open_layout` opens the runner of one layout's spec. With
    `processes` > 1, as many layouts at a time, each in a child process where `open_layout`
    opens its runner (`tune_side_by_side`): for an estimate's runners only.

    Raises:
        SpecError: the spec has no `training.target_global_batch`.
        AssertionError: the result breaks an invariant of `autotune.core.tuning.result_check`.
    """
    if spec.training.sharding is not Sharding.AUTO:
        raise ValueError(f"tune_layouts is for sharding: auto, not {spec.training.sharding}")
    spec.training.required_target_global_batch()
    study_name = study_name or f"autotune-{uuid.uuid4().hex[:12]}"
    layouts = layout_candidates(spec.training)
    jobs = [
        LayoutJob(
            index, layout_spec(spec, sharding), f"{study_name}-{sharding.value}"[:STUDY_NAME_MAX]
        )
        for index, sharding in enumerate(layouts)
    ]
    options = TuneOptions(storage_url, n_trials, seed, target_seconds)
    if processes > 1 and len(jobs) > 1:
        # The studies' tables made once here (children making them at once would race), its
        # connections closed before the children are forked.
        create_storage(storage_url).engine.dispose()
        results = tune_side_by_side(
            jobs,
            open_layout,
            options,
            processes=processes,
            on_attempt=on_attempt,
            on_trial=on_trial,
            on_phase=on_phase,
            on_layout=on_layout,
        )
    else:
        results = []
        for job in jobs:
            sharding = job.spec.training.sharding
            if on_layout is not None:
                on_layout(sharding, job.index, len(jobs))
            if on_phase is not None:
                on_phase(f"layout {job.index + 1} of {len(jobs)}: {LAYOUT_NAMES[sharding]}", None)
            results.append(
                tune_job(
                    job,
                    open_layout,
                    options,
                    on_attempt=on_attempt,
                    on_trial=on_trial,
                    on_phase=on_phase,
                )
            )
    runs = [
        LayoutRun(job.spec.training.sharding, result)
        for job, result in zip(jobs, results, strict=True)
    ]
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
