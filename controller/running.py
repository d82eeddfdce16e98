"""What each pool runs, as vLLM itself reports it, beside what specpilot pushed to it.

A push is a request, not a fact. The file and webhook actuators hand a config over and
know nothing more; an orchestrator may apply it late, partly or never. So what a pool is
believed to run changes only on evidence:

- **its shape** (γ, or off) from every scrape of each instance: no spec-decode series on
  the page is off; the number of ``position`` series of
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total`` is the γ it was started with
  (under a ``num_speculative_tokens_per_batch_size`` table, the table's largest γ);
- **the rest** (its method, a γ-by-batch-size table, tuning keys) from the actuator's
  read-back where it has one (the managed actuator knows the config it started), else
  what was believed so far (at start, the settings' ``speculative_config``). A pushed
  change is believed when each instance shows the pushed shape after a restart (its
  counters went back) that came after the push: vLLM takes a config only at start.

A push is ``pending`` until every instance seen since shows it, then ``confirmed`` (the
pool is believed to run it); one still pending ``confirm_within_s`` after it was made is
``not_applied``, which the loop raises as ``SpecpilotPushNotApplied`` until the evidence
shows the pushed config or a later push asks for what runs. A push of the config the
pool is believed to run already is confirmed at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from controller.contexts import bucket_range
from controller.fleet import Fleet
from controller.ports import InstanceSeen
from controller.specconfig import OFF, SpecConfigError, parse_arm, resolve_on_pool

Config = Mapping[str, Any] | None
"""A ``--speculative-config``; None runs no speculation."""
Clock = Callable[[], float]

TABLE_KEY = "num_speculative_tokens_per_batch_size"
UNKNOWN_METHOD = "unknown"


class PushState(StrEnum):
    CONFIRMED = "confirmed"
    PENDING = "pending"
    NOT_APPLIED = "not_applied"


def shape_of(config: Config) -> int:
    """How many ``position`` series an engine started with ``config`` exposes (0: off)."""
    if config is None:
        return 0
    return int(config.get("num_speculative_tokens") or 0)


def same_config(a: Config, b: Config) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and dict(a) == dict(b))


@dataclass(slots=True)
class _Instance:
    positions: int
    seen_at: float
    restarted_at: float | None = None


@dataclass(slots=True)
class Push:
    config: Config
    arm: str
    at: float
    state: PushState
    settled_at: float | None = None
    """When it was confirmed or found not applied."""


@dataclass(slots=True)
class _Pool:
    name: str
    believed: Config
    speculative: Config
    """The last speculative config believed: the method of a pool seen speculating
    while it was believed off (the push that turned it off did not take)."""
    push: Push | None = None
    instances: dict[str, _Instance] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolRunning:
    """One pool as ``/v1/fleet`` shows it."""

    running: str
    """The arm the evidence shows (``ngram:4``, ``off``; ``unknown`` before any scrape
    or while its instances disagree)."""
    pushed: str | None
    """The arm of the last push, if any."""
    state: PushState | None
    pushed_at: float | None
    settled_at: float | None


class RunningConfigs:
    """Per pool: the config believed running, the last push and whether it took."""

    def __init__(self, fleet: Fleet, *, confirm_within_s: float, clock: Clock) -> None:
        self.fleet, self.confirm_within_s, self.clock = fleet, confirm_within_s, clock
        self._pools: dict[str, _Pool] = {}
        for name, pool in fleet.pools.items():
            config = (
                None if pool.speculative_config.get("method") == OFF else pool.speculative_config
            )
            self._pools[name] = _Pool(name, config, config)
        self.read_back: dict[str, Callable[[], Config]] = {}
        """Per pool whose vLLM an actuator starts itself (managed pools), the config it
        knows that vLLM was started with."""

    # -- what runs -----------------------------------------------------------------------

    def believed(self, pool: str) -> Config:
        """The config ``pool`` is believed to run (what its windows are attributed to)."""
        return self._pools[pool].believed

    def speculative(self, pool: str) -> Config:
        """The speculative config whose method a speculating instance runs, when the
        believed config is off (see ``_Pool.speculative``)."""
        return self._pools[pool].speculative

    def running_shape(self, pool: str) -> int | None:
        """The γ (0: off) most of the pool's instances showed at their last scrape."""
        seen = self._pools[pool].instances
        if not seen:
            return None
        counts = Counter(i.positions for i in seen.values())
        return counts.most_common(1)[0][0]

    def running_config(self, pool: str) -> Config:
        """The believed config at the γ the instances show (a γ changed by someone
        else's restart is what runs, whatever was believed)."""
        state = self._pools[pool]
        shape = self.running_shape(pool)
        if shape is None:
            return state.believed
        if shape == 0:
            return None
        base = state.believed if state.believed is not None else state.speculative
        if base is None:  # it drafts, but nothing ever said with which method
            return {"method": UNKNOWN_METHOD, "num_speculative_tokens": shape}
        if shape_of(base) == shape:
            return base
        config = {k: v for k, v in base.items() if k != TABLE_KEY}
        config["num_speculative_tokens"] = shape
        return config

    def arm(self, pool: str, bucket: str | None = None) -> str:
        """The arm ``pool`` runs (at ``bucket``'s batch sizes, where its config sets γ by
        batch size), as the evidence shows it."""
        config = self.running_config(pool)
        return self.arm_of(pool, config, bucket)

    def arm_of(self, pool: str, config: Config, bucket: str | None = None) -> str:
        if config is None:
            return OFF
        settings = self.fleet.pools[pool]
        top = {k: v for k, v in config.items() if k != TABLE_KEY}
        try:
            arm = resolve_on_pool(top, pool, settings.proposer_list(), pinnable=False)
        except SpecConfigError:
            return f"{config.get('method', 'unknown')}:{shape_of(config)}"
        table = config.get(TABLE_KEY)
        parsed = parse_arm(arm)
        if not table or bucket is None or parsed is None:
            return arm
        start, _ = bucket_range(bucket, self.fleet.settings.buckets, settings.max_num_seqs)
        for low, high, gamma in table:
            if low <= start <= high:
                return OFF if gamma == 0 else f"{parsed[0]}:{gamma}"
        return arm

    def view(self, pool: str) -> PoolRunning:
        state = self._pools[pool]
        running = "unknown"
        if not state.instances:
            running = self.arm_of(pool, state.believed)
        elif len({i.positions for i in state.instances.values()}) == 1:
            running = self.arm(pool)
        push = state.push
        return PoolRunning(
            running,
            push.arm if push else None,
            push.state if push else None,
            push.at if push else None,
            push.settled_at if push else None,
        )

    # -- evidence ------------------------------------------------------------------------

    def pushed(self, pool: str, config: Config, at: float) -> Push:
        """A push was handed over; confirmed at once if it asks for what runs."""
        state = self._pools[pool]
        push = Push(config, self.arm_of(pool, config), at, PushState.PENDING)
        state.push = push
        if self._shows(state, push, at) or (
            self._same_run(pool, config, state.believed)
            and all(i.positions == shape_of(config) for i in state.instances.values())
        ):
            self._confirm(state, push, at)
        return push

    def _same_run(self, pool: str, a: Config, b: Config) -> bool:
        """Whether an engine started with ``a`` runs as one started with ``b``: the same
        arm and the same γ-by-batch-size table (tuning keys written differently aside)."""
        if a is None or b is None:
            return a is None and b is None
        return self.arm_of(pool, a) == self.arm_of(pool, b) and a.get(TABLE_KEY) == b.get(TABLE_KEY)

    def see(self, seen: InstanceSeen) -> None:
        state = self._pools.get(seen.pool)
        if state is None:
            return
        known = state.instances.get(seen.instance)
        instance = _Instance(seen.positions, seen.at)
        if known is not None:
            instance.restarted_at = known.restarted_at
        if seen.restarted:
            instance.restarted_at = seen.at
        state.instances[seen.instance] = instance

    def forget(self, pool: str, instance: str) -> None:
        """An instance no longer in the pool (its scrapes no longer count)."""
        self._pools[pool].instances.pop(instance, None)

    def settle(self) -> list[tuple[str, Push]]:
        """Confirm the pushes the evidence now shows and give up on those overdue;
        returns the pools whose push changed state, with it."""
        now = self.clock()
        changed = []
        for name, state in sorted(self._pools.items()):
            push = state.push
            if push is None or push.state is PushState.CONFIRMED:
                continue
            if self._shows(state, push, now):
                self._confirm(state, push, now)
                changed.append((name, push))
            elif push.state is PushState.PENDING and now - push.at >= self.confirm_within_s:
                push.state, push.settled_at = PushState.NOT_APPLIED, now
                changed.append((name, push))
        return changed

    def _shows(self, state: _Pool, push: Push, now: float) -> bool:
        """Whether every instance scraped since the push runs it (and one was)."""
        read_back = self.read_back.get(state.name)
        if read_back is not None and not same_config(read_back(), push.config):
            return False
        fresh = [i for i in state.instances.values() if i.seen_at >= push.at]
        if not fresh:
            return False
        want = shape_of(push.config)
        # vLLM takes a config only at start: a change is believed once the instance
        # restarted after the push (its method, a γ table, tuning keys: its page shows
        # none of them), or once the actuator that started it says so.
        changed = not self._same_run(state.name, push.config, state.believed)
        for instance in fresh:
            if instance.positions != want:
                return False
            if changed and read_back is None and not _restarted_after(instance, push.at):
                return False
        return True

    def _confirm(self, state: _Pool, push: Push, now: float) -> None:
        push.state, push.settled_at = PushState.CONFIRMED, now
        state.believed = push.config
        if push.config is not None:
            state.speculative = push.config


def _restarted_after(instance: _Instance, at: float) -> bool:
    return instance.restarted_at is not None and instance.restarted_at >= at
