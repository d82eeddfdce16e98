"""The gateway as ``specpilot serve`` runs it beside the API (``settings.gateway``).

- Routing mode (``actuators.mode: routing``): ``controller.routed`` — the policy picks
  a pool per request, and that is how its decisions take effect.
- Push mode with ``gateway.enabled``: :class:`ClassRouting` sends each request to the
  pool serving its class (the loop pushes that pool's config), and a managed pool's
  traffic follows the instance the managed actuator started (:func:`switch_traffic`).

Either way every request becomes an observation for the loop (the ``sink``), and the
classifier is the one ``gateway.classifier`` names (:func:`classifier_from`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from controller.actuators.configured import ConfigSwitch
from controller.actuators.managed import SpecConfig
from controller.fleet import Fleet
from controller.gateway import Classifier, ConstantClassifier, Gateway, ObservationSink
from controller.gateway.routing import Fleet as GatewayFleet
from controller.gateway.routing import Pool
from controller.ports import ControlPolicy
from controller.routed import pool_arms, routed_gateway
from controller.settings import BUILTIN_CLASSIFIER, Settings, default_class
from controller.specconfig import OFF, SpecConfigError, resolve_on_pool
from controller.wiring import BanditControlPolicy
from policies.arms import ConcurrencyBuckets


class ModelClassifier:
    """The scikit-learn classifier (``policies.classifier``) as the gateway's
    ``Classifier``: a class the request names (``metadata.workload_class``, ...) or the
    predicted one, replaced by ``fallback`` when the settings do not list it."""

    def __init__(self, model: Any, classes: tuple[str, ...], fallback: str) -> None:
        self.model, self.classes, self.fallback = model, frozenset(classes), fallback

    def __call__(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        from policies.classifier import explicit_class, prompt_text, request_temperature

        explicit = explicit_class(headers, body)
        if explicit is not None:
            name = explicit[0]
        else:
            name = self.model.predict(prompt_text(body), request_temperature(body)).workload_class
        return name if name in self.classes else self.fallback


def classifier_from(settings: Settings) -> Classifier:
    """What ``gateway.classifier`` names; the model is trained here (about a second),
    before the gateway takes traffic."""
    fallback = default_class(settings)
    path = settings.gateway.classifier
    if path is None:
        return ConstantClassifier(fallback)
    from policies.classifier import default_classifier, loads_recipe, train_classifier

    if path == BUILTIN_CLASSIFIER:
        model = default_classifier()
    else:
        with open(path, encoding="utf-8") as file:
            model = train_classifier(loads_recipe(file.read(), path))
    return ModelClassifier(model, tuple(settings.classes), fallback)


class ClassRouting:
    """Push mode: a request goes to a pool of its model serving its class, preferring
    one whose config that class sets (its primary class); else the default pool."""

    def __init__(self, settings: Settings, default_pool: str) -> None:
        self.fleet = Fleet(settings)
        self.default_model = settings.models[0]
        self.default_pool = default_pool
        self._routes: dict[tuple[str, str], str] = {}

    def pool_for(self, model: str | None, workload_class: str, bucket: str) -> str:
        key = (model or self.default_model, workload_class)
        pool = self._routes.get(key)
        if pool is None:
            names = self.fleet.pools_for(*key)
            primary = [n for n in names if self.fleet.primary_class(self.fleet.pools[n]) == key[1]]
            pool = (primary or list(names) or [self.default_pool])[0]
            self._routes[key] = pool
        return pool


def gateway_from(settings: Settings, policy: ControlPolicy, sink: ObservationSink) -> Gateway:
    """The gateway ``serve`` runs: routing by the policy in routing mode, by class in
    push mode. Routing mode needs the bandit built with ``topology="per_arm"``."""
    classifier = classifier_from(settings)
    if settings.actuators.mode == "routing":
        if not isinstance(policy, BanditControlPolicy):
            raise TypeError("routing mode needs specpilot's bandit (controller.wiring)")
        gateway, _ = routed_gateway(settings, policy.policy, sink, classifier=classifier)
        return gateway
    arms = pool_arms(settings)
    pools = [
        Pool(name, arms[name], pool.instances) if pool.instances else Pool.empty(name, arms[name])
        for name, pool in sorted(settings.fleet.pools.items())
    ]
    default = next((p.name for p in pools if p.instances), pools[0].name)
    return Gateway(
        GatewayFleet(pools, default_pool=default, clock=time.monotonic),
        routing=ClassRouting(settings, default),
        classifier=classifier,
        sink=sink,
        buckets=ConcurrencyBuckets(tuple(settings.buckets)),
    )


def switch_traffic(settings: Settings, gateway: Gateway) -> ConfigSwitch:
    """The managed actuator's traffic switch: the gateway's pool gets the new instances
    and the arm their config runs (what its observations are tagged with)."""

    def switch(pool: str, urls: tuple[str, ...], config: SpecConfig) -> None:
        proposers = settings.fleet.pools[pool].proposer_list()
        try:
            arm = resolve_on_pool(config or {"method": OFF}, pool, proposers, pinnable=False)
        except SpecConfigError:
            arm = OFF if config is None else str(config.get("method"))
        gateway.fleet.set_instances(pool, urls, arm)

    return switch
