"""LiveBytesTracker: byte-exact peaks, freeing, emulated OOM in every phase, rounding, series."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.optim import optimizer as optimizer_module

from autotune.core.memory.allocation_trace import replay_encoded
from autotune.core.memory.allocator import CachingAllocator
from autotune.core.schemas import Phase
from autotune.engine.emulation.tracker import LiveBytesTracker, resident_tensors

SEQ_LEN = 32
VOCAB = 256


class _Block(nn.Module):
    """A pre-norm transformer block: causal SDPA attention and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A two-layer GPT-ish language model: small enough for a step in a few milliseconds."""

    def __init__(self, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(SEQ_LEN, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


class Trainer:
    """A model and AdamW in steady state (the optimizer state exists before any tracked step)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TinyLM()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step_fn(self.batch(1))()

    def batch(self, micro_batch: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (micro_batch, SEQ_LEN))

    def step_fn(self, ids: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            self.model(ids).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return step

    def tracker(
        self, ids: torch.Tensor, capacity_bytes: int | None = None, **kw: object
    ) -> LiveBytesTracker:
        tracker = LiveBytesTracker(capacity_bytes, **kw)  # type: ignore[arg-type]
        tracker.add_resident([*resident_tensors(self.model, self.optimizer), ids])
        return tracker


@pytest.fixture
def trainer() -> Trainer:
    return Trainer()


def _run(trainer: Trainer, micro_batch: int, **kw: object) -> LiveBytesTracker:
    ids = trainer.batch(micro_batch)
    tracker = trainer.tracker(ids, **kw)  # type: ignore[arg-type]
    with tracker:
        trainer.step_fn(ids)()
    return tracker


@pytest.mark.parametrize("micro_batch", [2, 5])
def test_peak_matches_memtracker_to_the_byte(trainer: Trainer, micro_batch: int) -> None:
    ids = trainer.batch(micro_batch)
    step = trainer.step_fn(ids)
    tracker = trainer.tracker(ids, block_bytes=1)
    with tracker:
        step()
    reference = MemTracker()  # a new one per step: it refuses a second root-module call
    reference.track_external(trainer.model, trainer.optimizer, ids)
    with reference:
        step()
    expected_bytes = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert tracker.peak_bytes == expected_bytes
    assert tracker.op_count > 100


def test_live_bytes_return_to_the_resident_set_after_a_step(trainer: Trainer) -> None:
    ids = trainer.batch(4)
    tracker = trainer.tracker(ids)
    resident_bytes = tracker.live_bytes
    params_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    # Parameters plus two AdamW moments, each at least as large as the parameters.
    assert resident_bytes >= 3 * params_bytes
    with tracker:
        trainer.step_fn(ids)()
    assert tracker.peak_bytes > resident_bytes
    assert tracker.live_bytes == resident_bytes


def test_views_and_in_place_ops_are_not_counted_twice() -> None:
    tracker = LiveBytesTracker(None, block_bytes=1)
    with tracker:
        x = torch.ones(1024)  # 4096 bytes
        view = x.view(32, 32)
        x.add_(1)
        view.mul_(2)
        strided = x[::2]
        assert tracker.live_bytes == 4096
        values, indices = view.max(dim=0)  # a tuple output: two new storages
        assert tracker.live_bytes == 4096 + 32 * 4 + 32 * 8
        summed = torch._foreach_add([x, values], 1.0)  # a list output
        assert tracker.live_bytes == 2 * 4096 + 2 * 32 * 4 + 32 * 8
        del values, indices, summed
        assert tracker.live_bytes == 4096
        del x, view
        assert tracker.live_bytes == 4096  # `strided` still holds the storage
        del strided
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 2 * 4096 + 2 * 32 * 4 + 32 * 8


def test_resize_is_counted() -> None:
    tracker = LiveBytesTracker(None, block_bytes=1)
    with tracker:
        x = torch.empty(0)
        assert tracker.live_bytes == 0
        x.resize_(1000)  # aten.resize_: a known storage grows in place
        assert tracker.live_bytes == 4000
        x.untyped_storage().resize_(40)  # bypasses the dispatcher (FSDP frees this way)
        assert tracker.live_bytes == 40
    assert tracker.peak_bytes == 4000
    del x
    assert tracker.live_bytes == 0


def test_storages_are_rounded_to_blocks() -> None:
    tracker = LiveBytesTracker(None)  # 512-byte blocks by default, like the CUDA allocator
    resident = torch.empty(1, dtype=torch.uint8)
    tracker.add_resident([resident, resident.view(1, 1)])  # one storage, counted once
    assert tracker.live_bytes == 512
    with tracker:
        a = torch.ones(513, dtype=torch.uint8)
        assert tracker.live_bytes == 512 + 1024
        b = torch.ones(128)  # exactly 512 bytes
        assert tracker.live_bytes == 512 + 1024 + 512
        empty = torch.ones(0)
        assert tracker.live_bytes == 512 + 1024 + 512
        del a, b, empty
    assert tracker.live_bytes == 512
    exact = LiveBytesTracker(None, block_bytes=1)
    kept = torch.empty(3, dtype=torch.uint8)
    exact.add_resident([kept])
    assert exact.live_bytes == 3
    del kept
    assert exact.live_bytes == 0


def test_add_resident_counts_gradients(trainer: Trainer) -> None:
    trainer.model(trainer.batch(1)).backward()
    with_grads = LiveBytesTracker(None, block_bytes=1)
    with_grads.add_resident(trainer.model.parameters())
    params_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert with_grads.live_bytes == 2 * params_bytes
    trainer.optimizer.zero_grad(set_to_none=True)
    assert with_grads.live_bytes == params_bytes


def test_phases_are_labelled_and_hooks_removed(trainer: Trainer) -> None:
    pre_hooks = len(optimizer_module._global_optimizer_pre_hooks)
    post_hooks = len(optimizer_module._global_optimizer_post_hooks)
    tracker = _run(trainer, 3)
    assert set(tracker.phase_peak_bytes) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    assert max(tracker.phase_peak_bytes.values()) == tracker.peak_bytes
    # This model peaks at the start of backward (logits and their gradient are both live).
    assert tracker.phase_peak_bytes[Phase.BACKWARD] == tracker.peak_bytes
    assert tracker.phase_peak_bytes[Phase.FORWARD] < tracker.peak_bytes
    assert tracker.phase is Phase.OPTIMIZER  # the last op ran in step(); zero_grad runs none
    assert len(optimizer_module._global_optimizer_pre_hooks) == pre_hooks
    assert len(optimizer_module._global_optimizer_post_hooks) == post_hooks


def test_no_capacity_never_raises() -> None:
    tracker = LiveBytesTracker(None)
    with tracker:
        big = torch.empty(1 << 20)
    assert tracker.peak_bytes == 4 << 20
    del big


def _oom_at(
    trainer: Trainer, ids: torch.Tensor, capacity_bytes: int
) -> tuple[LiveBytesTracker, str, int]:
    tracker = trainer.tracker(ids, capacity_bytes)
    resident_bytes = tracker.live_bytes
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with tracker:
            trainer.step_fn(ids)()
    message = str(caught.value)
    del caught  # the traceback holds the step's tensors (pytorch#18853)
    return tracker, message, resident_bytes


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD])
def test_oom_at_capacity_then_full_recovery(trainer: Trainer, phase: Phase) -> None:
    clean = _run(trainer, 4)
    forward_peak = clean.phase_peak_bytes[Phase.FORWARD]
    if phase is Phase.FORWARD:
        capacity_bytes = (clean.live_bytes + forward_peak) // 2
    else:  # between the forward and the backward peak: forward fits, backward does not
        capacity_bytes = (forward_peak + clean.peak_bytes) // 2
    ids = trainer.batch(4)
    tracker, message, resident_bytes = _oom_at(trainer, ids, capacity_bytes)

    assert tracker.phase is phase
    assert f"phase {phase.value}" in message
    assert message.startswith("CUDA out of memory (emulated). Tried to allocate ")
    assert resident_bytes < tracker.peak_bytes <= capacity_bytes
    if phase is Phase.BACKWARD:
        assert tracker.phase_peak_bytes[Phase.FORWARD] == forward_peak
    # An OOM part-way through backward leaves some gradients behind, as on a real GPU.
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert tracker.live_bytes == resident_bytes
    assert _run(trainer, 4).peak_bytes == clean.peak_bytes


def test_oom_inside_the_optimizer_step(trainer: Trainer) -> None:
    # foreach AdamW allocates its temporaries inside step(): a budget just below the optimizer
    # peak, with the forward/backward of a tiny batch well under it, fails there.
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), foreach=True)
    trainer.step_fn(trainer.batch(1))()
    clean = _run(trainer, 1)
    optimizer_peak = clean.phase_peak_bytes[Phase.OPTIMIZER]
    assert optimizer_peak == clean.peak_bytes
    tracker, message, _ = _oom_at(trainer, trainer.batch(1), optimizer_peak - 1)
    assert tracker.phase is Phase.OPTIMIZER
    assert "phase optimizer" in message
    assert tracker.peak_bytes < optimizer_peak


def test_series_has_one_entry_per_op_and_is_affine_in_batch(trainer: Trainer) -> None:
    # Exact bytes: with 512-byte blocks each storage is only affine up to its rounding.
    runs = {b: _run(trainer, b, block_bytes=1, record_series=True) for b in (2, 3, 6)}
    for tracker in runs.values():
        assert len(tracker.series) == tracker.op_count
        assert max(tracker.series) == tracker.peak_bytes
    assert len(runs[2].series) == len(runs[3].series) == len(runs[6].series)
    # Per-op affine fit on b=2,3 predicts the b=6 peak exactly (docs/design.md#per-op-fit).
    slopes = [s3 - s2 for s2, s3 in zip(runs[2].series, runs[3].series, strict=True)]
    predicted = max(s2 + (6 - 2) * k for s2, k in zip(runs[2].series, slopes, strict=True))
    assert predicted == runs[6].peak_bytes
    assert _run(trainer, 2).series == []  # not recorded unless asked


# With the caching-allocator model (docs/design.md#the-caching-allocator-on-the-emulated-gpu).


def test_storages_live_in_the_allocator_and_the_trace_records_them() -> None:
    allocator = CachingAllocator(64 * 2**20)
    weights = torch.empty(1000)
    tracker = LiveBytesTracker(None, allocator=allocator, record_series=True)
    tracker.add_resident([weights])
    with tracker:
        x = torch.ones(3 * 2**20, dtype=torch.uint8)  # a 1-10 MiB request: a 20 MiB segment
        x.resize_(5 * 2**20)  # a new block, the old one freed
        x.untyped_storage().resize_(0)  # how FSDP frees: nothing left to hold
        del x
    stats = allocator.stats
    assert stats.allocated_bytes == 4096  # the weights only
    assert stats.peak_reserved_bytes == 2 * 2**20 + 20 * 2**20
    assert tracker.allocations == [4000, 3 * 2**20, 5 * 2**20, -2, 0, -3, -5]
    # Replayed, the recorded trace reserves what the step reserved.
    replayed = replay_encoded(tracker.allocations, 64 * 2**20)
    assert replayed.stats.peak_reserved_bytes == stats.peak_reserved_bytes


def test_the_allocator_running_out_is_an_out_of_memory_at_that_op() -> None:
    tracker = LiveBytesTracker(None, allocator=CachingAllocator(20 * 2**20))
    kept = []
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 20\.00 MiB"), tracker:
        for _ in range(4):
            kept.append(torch.ones(6 * 2**20, dtype=torch.uint8))
    # Three 6 MiB blocks share one 20 MiB segment; the fourth needs another.
    assert len(kept) == 3
    del kept
    gc.collect()
    assert tracker.allocator is not None and tracker.allocator.stats.allocated_bytes == 0


def test_the_out_of_memory_messages_give_torchs_figures_in_mib() -> None:
    # The allocator's message: the request, the capacity, allocated and cached-but-free.
    tracker = LiveBytesTracker(None, allocator=CachingAllocator(20 * 2**20))
    kept = []
    with pytest.raises(torch.OutOfMemoryError) as raised, tracker:
        for _ in range(4):
            kept.append(torch.ones(6 * 2**20, dtype=torch.uint8))
    assert str(raised.value) == (
        "CUDA out of memory (emulated). Tried to allocate 20.00 MiB; capacity 20.00 MiB, of "
        "which 18.00 MiB is allocated by PyTorch and 2.00 MiB is reserved by PyTorch but "
        "unallocated; phase forward"
    )
    del kept
    # Counting live bytes only: the request, the capacity and what was live before it.
    tracker = LiveBytesTracker(3 * 2**20)
    with pytest.raises(torch.OutOfMemoryError) as raised, tracker:
        first = torch.ones(2 * 2**20, dtype=torch.uint8)
        torch.ones(2 * 2**20, dtype=torch.uint8)
    assert str(raised.value).startswith(
        "CUDA out of memory (emulated). Tried to allocate 2.00 MiB in aten.ones.default; "
        "capacity 3.00 MiB, 2.00 MiB live, phase forward"
    )
    del first


def test_a_step_may_fill_the_capacity_exactly_and_a_zero_capacity_holds_nothing() -> None:
    with LiveBytesTracker(2 * 2**20) as tracker:
        full = torch.ones(2 * 2**20, dtype=torch.uint8)
    assert tracker.peak_bytes == 2 * 2**20
    del full
    with pytest.raises(torch.OutOfMemoryError), LiveBytesTracker(0):
        torch.ones(1)


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="block_bytes must be >= 1, got 0"):
        LiveBytesTracker(None, block_bytes=0)
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -1"):
        LiveBytesTracker(-1)


def test_a_step_that_allocates_nothing_peaks_at_nothing() -> None:
    with LiveBytesTracker(None) as tracker:
        pass
    assert (tracker.peak_bytes, tracker.live_bytes, tracker.phase_peak_bytes) == (0, 0, {})


def test_the_trace_records_frees_inside_the_step_only_and_nothing_unrecorded() -> None:
    tracker = LiveBytesTracker(None, record_series=True)
    with tracker:
        first = torch.ones(1024, dtype=torch.uint8)
        kept = torch.ones(2048, dtype=torch.uint8)
        del first  # event 0 freed inside the step: recorded as -1
    del kept  # freed after the step: the caller's, not recorded
    assert tracker.allocations == [1024, 2048, -1]
    quiet = LiveBytesTracker(None)
    with quiet:
        dropped = torch.ones(1024, dtype=torch.uint8)
        del dropped
    assert quiet.allocations == [] and quiet.series == []


def test_ops_after_the_optimizer_step_are_not_the_optimizers(trainer: Trainer) -> None:
    ids = trainer.batch(2)
    tracker = trainer.tracker(ids)
    with tracker:
        trainer.step_fn(ids)()
        after = torch.ones(10 * 2**20, dtype=torch.uint8)  # the largest allocation of all
    assert tracker.phase_peak_bytes[Phase.FORWARD] > 10 * 2**20
    assert tracker.phase_peak_bytes[Phase.OPTIMIZER] < 10 * 2**20
    del after


def test_a_phase_that_allocates_nothing_still_has_its_peak() -> None:
    # Plain SGD updates in place: its step allocates nothing, yet it is a phase of the step,
    # and its peak is what was live through it.
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    model(ids).backward()
    tracker = LiveBytesTracker(None)
    tracker.add_resident([*resident_tensors(model, optimizer), ids])
    with tracker:
        optimizer.step()
    assert tracker.phase_peak_bytes == {Phase.OPTIMIZER: tracker.live_bytes}
