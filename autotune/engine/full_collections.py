"""When CPython's cyclic garbage collector may scan the whole heap during a probe or a tune.

A traced trial makes about a million short-lived objects (fake tensors, the autograd graph, the
journal of its allocations) over a heap of some 560,000 long-lived ones (torch's, transformers'
and the other imported modules' functions, types and dicts). CPython runs a full collection
whenever enough young objects survived, and each scans the whole heap: a Llama-3-8B LoRA
`tune --estimate` ran 12 of them, 4.5 of its 40 CPU s; a 70B probe 10, 3 s (counted with
`gc.callbacks`; docs/design.md#the-layer-replay, "What a traced op costs"). Freezing the
imported heap does not help: the trials' own survivors are most of what a full collection
scans, and a freeze only brings the next one sooner.

So while a probe, a tune or a search over layouts or sequence lengths runs, only the young
generations are collected (each object is still looked at once or twice: 1 s of the tune);
cyclic garbage that lives long enough to be promoted waits for the first full collection after
it, which the collector's own thresholds start again. The whole heap of the 8B tune grew by
37 MiB with no collection at all, so what waits is small.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Far more young collections than any session makes (an 8B tune makes some 4,000).
_NO_FULL_COLLECTION = 2**30

_lock = threading.Lock()
_depth = 0
_thresholds: tuple[int, int, int] | None = None


@contextmanager
def few_full_collections() -> Iterator[None]:
    """No automatic full collection inside (young ones go on); nested and concurrent sessions
    share one window, and the thresholds come back as they were when the last one leaves."""
    global _depth, _thresholds
    with _lock:
        if _depth == 0:
            _thresholds = gc.get_threshold()
            young, middle = _thresholds[0], _thresholds[1]
            gc.set_threshold(young, middle, _NO_FULL_COLLECTION)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _thresholds is not None:
                gc.set_threshold(*_thresholds)
                _thresholds = None


def with_few_full_collections(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """`function`, run inside `few_full_collections`."""

    @wraps(function)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with few_full_collections():
            return function(*args, **kwargs)

    return wrapped
