"""The fleet as the controller reasons about it: which pools serve a context, which
arms a context may run, and each pool's effective ``--speculative-config``.

One ``--speculative-config`` per pool: a pool takes its config from the decisions of
its primary class (the first it serves) across the concurrency buckets. Decode batch
size tracks concurrency, so per-bucket choices of one proposer become vLLM's
``num_speculative_tokens_per_batch_size`` table (γ by batch size, 0 = off). When buckets
want different proposers, the proposer chosen in the most buckets wins (ties: the one
chosen at the lowest concurrency, where speculation pays most) and the other buckets
run with γ = 0 there; routing each class to its own pool is the gateway's job.

Routing mode (``actuators.mode: routing``) is the other way round: every pool keeps the
one config it runs and the gateway sends each request to the pool running the arm the
policy picked for it (the routing table the loop publishes, ``ControlLoop.routes_to``).
A context may then run any arm some pool runs (each request goes to that one pool), it
starts on ``off`` (where the gateway
sends a context the policy has not committed yet, and where an arm no pool runs ends
up), and an override may pin any arm some pool runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.contexts import Context, bucket_range
from controller.settings import PoolSettings, Settings
from controller.specconfig import (
    OFF,
    SpecConfigError,
    arm_config,
    check_vllm_schema,
    parse_arm,
    resolve_on_pool,
)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A pool's effective speculative config: None runs without speculation."""

    pool: str
    config: dict[str, Any] | None
    arms_by_bucket: tuple[tuple[str, str], ...]


def pool_arms(settings: Settings) -> dict[str, str]:
    """Each pool's running arm, from the config the settings say it runs."""
    return {
        name: resolve_on_pool(pool.speculative_config, name, pool.proposer_list(), pinnable=False)
        for name, pool in settings.fleet.pools.items()
    }


class Fleet:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pools: Mapping[str, PoolSettings] = settings.fleet.pools
        self.routing = settings.actuators.mode == "routing"
        """Routing mode: each pool runs one arm and the gateway routes by arm."""
        self.routable: tuple[str, ...] = ()
        """Routing mode: the arms the gateway can send a request to (off first)."""
        if self.routing:
            running = set(pool_arms(settings).values()) - {OFF}
            self.routable = (OFF, *sorted(running, key=_arm_order))
        self.contexts: tuple[Context, ...] = tuple(
            Context(model, cls, bucket)
            for model in settings.models
            for cls in settings.classes
            if self.pools_for(model, cls)
            for bucket in settings.bucket_labels
        )

    def serves(self, pool: PoolSettings, workload_class: str) -> bool:
        return pool.classes is None or workload_class in pool.classes

    def primary_class(self, pool: PoolSettings) -> str:
        return (pool.classes or self.settings.classes)[0]

    def pools_for(self, model: str, workload_class: str) -> tuple[str, ...]:
        return tuple(
            name
            for name, pool in sorted(self.pools.items())
            if pool.model == model and self.serves(pool, workload_class)
        )

    def allowed_arms(self, context: Context) -> tuple[str, ...]:
        """Arms every pool serving the context can run (off always); in routing mode,
        every arm some pool runs (the gateway sends each request to that pool)."""
        if self.routing:
            return self.routable
        per_pool = [
            {
                f"{p.name}:{g}"
                for p in self.pools[name].proposer_list()
                for g in range(p.gamma_min, p.gamma_max + 1)
            }
            for name in self.pools_for(context.model, context.workload_class)
        ]
        common = set.intersection(*per_pool) if per_pool else set()
        return (OFF, *sorted(common, key=_arm_order))

    def routed_arm(self, arm: str) -> str:
        """Routing mode: the arm a request the policy gave ``arm`` is served with (an arm
        no pool runs goes to the off pool, as the gateway's routing table sends it)."""
        return arm if arm in self.routable else OFF

    def running_arm(self, context: Context) -> str:
        """The arm the context's first pool runs according to the settings; in routing
        mode off, where the gateway sends a context the policy has not committed yet."""
        if self.routing:
            return OFF
        names = self.pools_for(context.model, context.workload_class)
        if not names:
            return OFF
        pool = self.pools[names[0]]
        return resolve_on_pool(
            pool.speculative_config, names[0], pool.proposer_list(), pinnable=False
        )

    def resolve_override(self, config: Mapping[str, Any], contexts: Sequence[Context]) -> str:
        """The arm an operator's config means on every pool serving these contexts.

        Raises ``SpecConfigError`` with the reason when a pool cannot run it, when the
        pools disagree on the arm, or when the scope matches nothing.
        """
        if not contexts:
            raise SpecConfigError("the scope matches no context the fleet serves")
        if self.routing:
            return self._resolve_routed(config)
        arms = set()
        for model, cls in sorted({(c.model, c.workload_class) for c in contexts}):
            for name in self.pools_for(model, cls):
                pool = self.pools[name]
                arms.add(resolve_on_pool(config, name, pool.proposer_list(), pinnable=True))
        if len(arms) != 1:
            raise SpecConfigError(
                f"the scope spans pools that name this config differently ({sorted(arms)}): "
                "narrow the scope to one model"
            )
        return arms.pop()

    def _resolve_routed(self, config: Mapping[str, Any]) -> str:
        """Routing mode: the arm of the one pool that runs ``config`` (each pool runs
        one config, so the arm must be one a pool runs, not just one it could run)."""
        check_vllm_schema(config)
        if config["method"] == OFF:
            return OFF
        reasons = []
        for name, pool in sorted(self.pools.items()):
            try:
                arm = resolve_on_pool(config, name, pool.proposer_list(), pinnable=True)
            except SpecConfigError as exc:
                reasons.append(str(exc))
                continue
            if arm in self.routable:
                return arm
            reasons.append(f"pool {name!r} could run {arm} but runs another config")
        raise SpecConfigError(
            f"no pool runs this config (pools run: {', '.join(self.routable)}; "
            + "; ".join(reasons)
            + ")"
        )

    def pool_config(self, name: str, arms: Mapping[Context, str]) -> PoolConfig:
        """The config pool ``name`` should run given every context's effective arm (in
        routing mode the one it runs, whatever the contexts run: they move by routing)."""
        pool = self.pools[name]
        if self.routing:
            arm = resolve_on_pool(
                pool.speculative_config, name, pool.proposer_list(), pinnable=False
            )
            config = None if arm == OFF else dict(pool.speculative_config)
            return PoolConfig(name, config, tuple((b, arm) for b in self.settings.bucket_labels))
        cls = self.primary_class(pool)
        by_bucket = [
            (bucket, arms.get(Context(pool.model, cls, bucket), OFF))
            for bucket in self.settings.bucket_labels
        ]
        parsed = [(bucket, parse_arm(arm)) for bucket, arm in by_bucket]
        chosen = [p for _, p in parsed if p is not None]
        if not chosen:
            return PoolConfig(name, None, tuple(by_bucket))
        votes = Counter(proposer for proposer, _ in chosen)
        first_seen = {proposer: i for i, (proposer, _) in reversed(list(enumerate(chosen)))}
        winner = max(votes, key=lambda p: (votes[p], -first_seen[p]))
        gammas = [(bucket, p[1] if p is not None and p[0] == winner else 0) for bucket, p in parsed]
        top = max(g for _, g in gammas)
        config = arm_config(f"{winner}:{top}", pool.proposer_list())
        assert config is not None
        if any(g != top for _, g in gammas):
            config["num_speculative_tokens_per_batch_size"] = [
                [*bucket_range(bucket, self.settings.buckets, pool.max_num_seqs), g]
                for bucket, g in gammas
                if bucket_range(bucket, self.settings.buckets, pool.max_num_seqs)[0]
                <= pool.max_num_seqs
            ]
        check_vllm_schema(config)
        return PoolConfig(name, config, tuple(by_bucket))

    def pools_of(self, contexts: Sequence[Context]) -> tuple[str, ...]:
        """Pools whose effective config depends on any of these contexts."""
        names = set()
        for context in contexts:
            for name in self.pools_for(context.model, context.workload_class):
                if self.primary_class(self.pools[name]) == context.workload_class:
                    names.add(name)
        return tuple(sorted(names))


def _arm_order(arm: str) -> tuple[str, int]:
    parsed = parse_arm(arm)
    return ("", 0) if parsed is None else parsed
