"""The gateway: an OpenAI-compatible reverse proxy that routes, relays and observes.

Public API: :class:`Gateway` (the ASGI app), :class:`Fleet` / :class:`Pool` (where
requests go), :class:`RoutingTable` / :class:`StaticRoutingTable` (what the control loop
updates), :class:`Classifier` / :class:`RequestKeys` (a request's class and model),
:class:`ObservationSink`.
"""

from controller.gateway.app import Gateway
from controller.gateway.classify import Classifier, ConstantClassifier, RequestKeys, UnknownModel
from controller.gateway.observe import ObservationSink, observation_from_response
from controller.gateway.routing import (
    EjectionPolicy,
    Fleet,
    Instance,
    NoInstanceAvailable,
    Pool,
    RouteKey,
    RoutingTable,
    StaticRoutingTable,
)
from controller.gateway.sse import SseRelay
from controller.gateway.upstream import UpstreamPool
from policies.arms import ConcurrencyBuckets

__all__ = [
    "Classifier",
    "ConcurrencyBuckets",
    "ConstantClassifier",
    "EjectionPolicy",
    "Fleet",
    "Gateway",
    "Instance",
    "NoInstanceAvailable",
    "ObservationSink",
    "Pool",
    "RequestKeys",
    "RouteKey",
    "RoutingTable",
    "SseRelay",
    "StaticRoutingTable",
    "UnknownModel",
    "UpstreamPool",
    "observation_from_response",
]
