"""What every export says beside its consumer's own keys: the batch arithmetic, the tokens per
step of a token target, and the notes on how the measured ranks shared their state.

One place for a note that concerns every consumer: `shared_notes` is the head of every text
(each consumer prefixes it with its comment syntax; the DeepSpeed JSON, which has none, gets it
in its notes text; the plain loop's docstring states all but the batch line, which it words
itself). A setting every consumer needs (an environment variable, say) belongs here, as does
keeping every batch at the measured size when smaller sizes run out.
"""

from __future__ import annotations

from autotune.core.exports.measured import ZERO_STAGES, MeasuredRun
from autotune.core.parallel.layouts import gathers_in_16_bits
from autotune.core.schemas import Sharding

# The variable torch 2.13 reads, and its older name, which still wins if set
# (`autotune.core.memory.allocator_config.config_from_environ`): every text takes it out, or a
# user's exported one would silently replace the measured settings.
ALLOCATOR_VARIABLE = "PYTORCH_ALLOC_CONF"
OLD_ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"


def shared_notes(run: MeasuredRun) -> list[str]:
    """Lines (without a comment marker) that head every consumer's text."""
    lines = [
        f"global batch {run.global_batch} = {run.micro_batch} per rank x "
        f"{run.accumulation_steps} accumulation steps x {run.world_size} rank(s)"
    ]
    tokens = run.tokens_per_sample
    if tokens is not None:
        lines.append(
            f"= {run.global_batch * tokens} tokens per optimizer step: packed samples of "
            f"{tokens} tokens each"
        )
    if run.runs_out_below:
        lines += [
            f"micro-batches {_sizes(run.runs_out_below)} run out where {run.micro_batch} fits",
            "(the allocator's cache is split differently at each size): keep every batch at",
            f"{run.micro_batch}, the last one too: drop_last=True in the DataLoader",
            "(dataloader_drop_last / drop_last in the configs), or pack samples",
        ]
    conf = run.allocator_conf
    if conf is not None:
        lines += [
            f"measured with the caching allocator's {conf}: set {ALLOCATOR_VARIABLE}={conf}",
            f"before CUDA starts (torch reads it once), with {OLD_ALLOCATOR_VARIABLE} unset (it",
            "wins); in a shell, before the launcher:",
            f"env -u {OLD_ALLOCATOR_VARIABLE} {ALLOCATOR_VARIABLE}={conf} "
            "accelerate launch / torchrun / deepspeed ... (Axolotl: its own line below)",
        ]
    return lines


def allocator_lines(run: MeasuredRun) -> str:
    """Python that sets the measured allocator settings, to run before torch is imported (and
    so before CUDA starts, when torch reads them); empty when the device's own were measured."""
    if run.allocator_conf is None:
        return ""
    return (
        "import os\n\n"
        "# Before torch is imported: CUDA reads the allocator's settings once, as it starts\n"
        f"# ({OLD_ALLOCATOR_VARIABLE}, the older name, would win over them).\n"
        f"os.environ.pop({OLD_ALLOCATOR_VARIABLE!r}, None)\n"
        f"os.environ[{ALLOCATOR_VARIABLE!r}] = {run.allocator_conf!r}\n"
    )


def _sizes(sizes: tuple[int, ...]) -> str:
    """ "10", "10 and 13", "4, 10 and 13"."""
    words = [str(size) for size in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def comment(lines: list[str], marker: str = "#") -> str:
    """`lines` as comment lines of a Python or YAML text."""
    return "".join(f"{marker} {line}\n" if line else f"{marker}\n" for line in lines)


def data_parallel_note(run: MeasuredRun) -> str:
    """How the measured ranks shared their state, for the `data_parallel` text (several ranks
    only)."""
    if run.sharding is Sharding.NONE:
        return comment(
            [
                f"{run.world_size} ranks: memory per rank was measured for torch DDP with",
                "gradient_as_bucket_view=True (gradients live in DDP's all-reduce buckets),",
                "default bucket sizes, buffers broadcast; the PyTorch loop and Lightning set it,",
                "the Hugging Face text shows where. DDP's default (False) holds a second copy of",
                "the gradients. DeepSpeed uses no torch DDP: without ZeRO it all-reduces after",
                "the last micro-batch's backward through flat copies of the gradients (up to 5e8",
                "elements each), a second copy of the gradients at the end of backward that was",
                "not measured.",
            ]
        )
    if run.sharding is Sharding.ZERO1:
        measured = [
            "torch DDP with ZeroRedundancyOptimizer (each rank the optimizer states of its",
            "share of the parameters); gradients all-reduced by DDP on the last micro-batch of",
            "each step only.",
        ]
    else:
        how = "fully_shard on each block, then the root"
        if gathers_in_16_bits(run.training):
            how += f", weights gathered in {run.autocast_dtype} and gradients reduced in fp32"
        if run.sharding is Sharding.ZERO2:
            how += ", without resharding after forward"
        if run.sharding is Sharding.HYBRID:
            groups = run.world_size // run.shard_group_size
            how += (
                f", sharded within groups of {run.shard_group_size} ranks, replicated across "
                f"{groups} groups"
            )
        measured = [
            f"torch FSDP2 ({how});",
            "gradients reduce-scattered after every micro-batch.",
        ]
    stage = ZERO_STAGES[run.sharding]
    return comment(
        [f"{run.world_size} ranks, ZeRO stage {stage}: memory per rank was measured with"]
        + measured
        + [
            "DeepSpeed's own ZeRO keeps flat buffers besides (reduce_bucket_size,",
            "allgather_bucket_size, stage 3's prefetch_bucket_size) that were not measured:",
            "leave them room or lower them.",
        ]
    )
