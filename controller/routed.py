"""Routing mode: pools keep their configs; each request goes where its arm runs.

When every pool runs one fixed ``--speculative-config`` (no restarts), a decision takes
effect by routing: the gateway asks the policy for the arm of the request's context
(the committed arm, or an exploration arm within the policy's cap) and sends the request
to a pool that runs it. This is the routing actuator of the design; ``specpilot demo``
and the real-vLLM loop tests run the service this way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from controller.contexts import Context
from controller.gateway import Classifier, Gateway, ObservationSink
from controller.gateway.routing import Fleet as GatewayFleet
from controller.gateway.routing import Pool
from controller.settings import Settings
from controller.specconfig import resolve_on_pool
from policies.arms import OFF, ConcurrencyBuckets
from policies.bandit import SpecPilotPolicy


class PolicyRouting:
    """The gateway's routing table, backed by the policy's per-request choice."""

    def __init__(
        self, policy: SpecPilotPolicy, pool_by_arm: Mapping[str, str], default_model: str
    ) -> None:
        if str(OFF) not in pool_by_arm:
            raise ValueError("routing mode needs a pool without speculation (the 'off' arm)")
        if policy.config.topology != "per_arm":
            # A shared-batch model would charge every pool for every other pool's load.
            raise ValueError("routing mode needs a policy built with topology='per_arm'")
        self.policy = policy
        self.pool_by_arm = dict(pool_by_arm)
        self.default_model = default_model
        self.seen: set[Context] = set()
        """Contexts traffic has reached, for read-outs such as the demo's table."""

    def pool_for(self, model: str | None, workload_class: str, bucket: str) -> str:
        context = Context(model or self.default_model, workload_class, bucket)
        self.seen.add(context)
        arm = self.policy.select(context)
        return self.pool_by_arm.get(str(arm), self.pool_by_arm[str(OFF)])


def pool_arms(settings: Settings) -> dict[str, str]:
    """Each pool's running arm, from the config the settings say it runs."""
    return {
        name: resolve_on_pool(pool.speculative_config, name, pool.proposer_list(), pinnable=False)
        for name, pool in settings.fleet.pools.items()
    }


def routed_gateway(
    settings: Settings,
    policy: SpecPilotPolicy,
    sink: ObservationSink,
    *,
    classifier: Classifier | None = None,
) -> tuple[Gateway, PolicyRouting]:
    """A gateway over the settings' pools that routes by the policy's choice, bucketing
    concurrency with the settings' edges (the policy's contexts use the same)."""
    arms = pool_arms(settings)
    pools = [Pool(name, arms[name], pool.instances) for name, pool in settings.fleet.pools.items()]
    routing = PolicyRouting(
        policy, {arm: name for name, arm in arms.items()}, default_model=settings.models[0]
    )
    gateway = Gateway(
        GatewayFleet(pools, clock=time.monotonic),
        routing=routing,
        classifier=classifier,
        sink=sink,
        buckets=ConcurrencyBuckets(tuple(settings.buckets)),
    )
    return gateway, routing
