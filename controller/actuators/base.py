"""The actuator interface: hand each changed pool's effective config to the fleet.

An actuator receives the pools whose effective ``--speculative-config`` changed (see
``controller.fleet.PoolConfig``). It must be idempotent: on start and after a restart
the loop hands it every pool again. It raises on failure; the loop records the failure
and hands the pool over again on the next iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from controller.fleet import PoolConfig


class Actuator(Protocol):
    name: str

    async def apply(self, configs: Sequence[PoolConfig]) -> None: ...


K = TypeVar("K")


def wrapped(actuator: object, kind: type[K]) -> K | None:
    """``actuator`` or what it wraps (``inner``: pacing, a pool filter, rolling restarts),
    whichever is a ``kind`` first; None if none is."""
    inner = actuator
    while not isinstance(inner, kind):
        if not hasattr(inner, "inner"):
            return None
        inner = inner.inner
    return inner
