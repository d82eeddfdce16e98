"""What every policy offers the simulator, the benchmark and the controller.

A policy is asked for an arm once per request (``select``, which may explore), is told
what each finished request measured (``observe``), and can say what it currently
believes is best for a context without exploring (``best_guess``). Everything else —
clock, randomness — is injected when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from collectors.observations import RequestObservation
from policies.arms import Arm, Context

Clock = Callable[[], float]
"""Seconds on some monotonic time line (the simulator's, or wall clock in the service)."""


class Policy(Protocol):
    name: str

    def select(self, context: Context) -> Arm:
        """The arm to serve one request of this context with (may explore)."""
        ...

    def best_guess(self, context: Context) -> Arm:
        """The arm the policy believes best for this context now, without exploring."""
        ...

    def observe(self, observation: RequestObservation) -> None:
        """Learn from one finished request."""
        ...
