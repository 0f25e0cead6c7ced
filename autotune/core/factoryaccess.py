"""Which user factories a probe worker may import: an allow-list of module prefixes (torch-free).

A `factory` spec names code (`"package.module:function"`) that the process building the model
imports and calls. On your own machine (`autotune probe`, `autotune tune`) that is your code
and runs unchecked. A probe worker runs specs that anyone holding a client token submitted, so
it imports a factory only when the factory's module lies under a prefix it was started with
(`autotune worker --allow-factory PREFIX`, repeatable); with none, it refuses every factory.

Prefixes match on dotted module boundaries: `tests` allows `tests` and `tests.x.y`, never
`testsuite`; `tests.x` allows `tests.x` and `tests.x.y`, never `tests`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from autotune.core.errors import FactoryRefused

_PREFIX = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)


def parse_prefix(text: str) -> str:
    """`text` as a module prefix (`pkg` or `pkg.sub`).

    Raises:
        ValueError: not a dotted module name.
    """
    if not _PREFIX.fullmatch(text):
        raise ValueError(f"not a dotted module name (e.g. mypkg or mypkg.models): {text!r}")
    return text


def factory_module(factory: str) -> str:
    """The module part of `"package.module:function"`."""
    return factory.partition(":")[0]


def is_factory_allowed(factory: str, prefixes: Sequence[str]) -> bool:
    """True when the factory's module is one of `prefixes` or lies under one of them."""
    module = factory_module(factory)
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def check_factory_allowed(factory: str, prefixes: Sequence[str]) -> None:
    """Raise `FactoryRefused` unless `factory` is allowed; imports nothing either way."""
    if is_factory_allowed(factory, prefixes):
        return
    module = factory_module(factory)
    if prefixes:
        allowed = f"allows factories only under {', '.join(prefixes)}"
    else:
        allowed = "allows no factories"
    raise FactoryRefused(
        f"factory {factory!r} refused: this worker {allowed}; to run it, start a worker with "
        f"--allow-factory {module.split('.')[0]} (or a narrower prefix of {module!r})"
    )
