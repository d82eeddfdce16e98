"""Where the gateway's per-request observations go.

Reading vLLM's per-request figures is ``collectors.per_request``'s job; the gateway
re-exports its ``observation_from_response`` so it has one place to call.
"""

from __future__ import annotations

from collections.abc import Callable

from collectors.observations import RequestObservation
from collectors.per_request import observation_from_response

__all__ = ["ObservationSink", "observation_from_response"]

ObservationSink = Callable[[RequestObservation], None]
"""Receives every finished request (the policy's feed). Called in the event loop, so it
must be quick and must not block: queue the observation if the work is heavy."""
