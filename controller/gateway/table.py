"""The routing table a gateway worker routes by, as the control loop publishes it.

The loop (in the ``serve`` process) hands every iteration's table to
:class:`SnapshotFile`, which writes it as one small JSON document, atomically (a new
file renamed over the old one) and only when it changed. Each worker checks the file's
identity a few times a second (one ``stat``) and loads a new one. A file rather than a
pipe: a worker that starts while the control plane is down (the database unreachable at
start, the loop stalled or not started yet) routes by what was last published, by this
run or the one before, and nothing the loop does can block a worker.

Per context the table holds a :class:`Route`: the committed arm and the shares it
explores. :class:`SampledRouting` picks a request's arm from it with one random number
(no call to anyone per request) and reports every pick (``on_routed``), which the loop's
policy counts as if it had chosen the request itself.

The snapshot also carries each pool's arm and instances, so a managed pool's move to a
new instance (push mode) reaches every worker the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from controller.gateway.routing import Fleet, RouteKey

logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "gateway-routing.json"
"""The table's file in the data directory."""
POLL_S = 0.1
"""How often a worker checks whether a new table was published."""
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Route:
    """Where the gateway sends one context's requests (routing mode), as a table entry a
    gateway worker samples from per request without asking anyone.

    ``arm`` (committed, for ``reason``) serves every request but the shares in
    ``explore``: each ``(arm, share, reason)`` takes that share of them (an exploration,
    a probe, a knee trial)."""

    arm: str
    reason: str = "learning"
    explore: tuple[tuple[str, float, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """What the workers route by: each pool's arm and instances, and (routing mode) each
    context's route; ``routes`` None leaves a worker's own routing (push mode's by class)."""

    pools: Mapping[str, tuple[str, tuple[str, ...]]]
    routes: Mapping[RouteKey, Route] | None = None
    version: int = 0

    def to_json(self) -> bytes:
        routes = None
        if self.routes is not None:
            routes = [
                [key.model, key.workload_class, key.bucket, route.arm, route.reason,
                 [list(entry) for entry in route.explore]]
                for key, route in sorted(self.routes.items(), key=_route_order)
            ]  # fmt: skip
        document = {
            "format": FORMAT,
            "version": self.version,
            "pools": {name: [arm, list(urls)] for name, (arm, urls) in sorted(self.pools.items())},
            "routes": routes,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RoutingSnapshot:
        """Raises ``ValueError`` for anything this version did not write."""
        try:
            document = json.loads(data)
            if document.get("format") != FORMAT:
                raise ValueError(f"format {document.get('format')!r}, not {FORMAT}")
            pools = {
                str(name): (str(arm), tuple(str(u) for u in urls))
                for name, (arm, urls) in document["pools"].items()
            }
            routes: dict[RouteKey, Route] | None = None
            if document["routes"] is not None:
                routes = {}
                for model, cls_, bucket, arm, reason, explore in document["routes"]:
                    entries = tuple((str(a), float(s), str(r)) for a, s, r in explore)
                    routes[RouteKey(model, str(cls_), str(bucket))] = Route(
                        str(arm), str(reason), entries
                    )
            return cls(pools, routes, int(document["version"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a routing snapshot: {exc!r}") from exc

    def same_table(self, other: RoutingSnapshot | None) -> bool:
        return other is not None and (self.pools, self.routes) == (other.pools, other.routes)


def _route_order(item: tuple[RouteKey, Route]) -> tuple[str, str, str]:
    key = item[0]
    return (key.model or "", key.workload_class, key.bucket)


class SnapshotFile:
    """The published table's file: written atomically, read back whole."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._identity: tuple[int, int, int] | None = None

    def write(self, snapshot: RoutingSnapshot) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(snapshot.to_json())
            os.replace(name, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise

    def read(self) -> RoutingSnapshot | None:
        """The file's snapshot; None when there is none or it cannot be read (logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("routing table %s cannot be read: %s", self.path, exc)
            return None
        try:
            return RoutingSnapshot.from_json(data)
        except ValueError as exc:
            logger.warning("routing table %s ignored: %s", self.path, exc)
            return None

    def changed(self) -> bool:
        """Whether the file is another one than at the last call (one ``stat``)."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return False
        identity = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if identity == self._identity:
            return False
        self._identity = identity
        return True


_Entry = tuple[str, str, tuple[tuple[float, str, str], ...]]
"""A route as sampled: the arm, its reason, and (cumulative share, arm, reason) each."""

OnRouted = Callable[[str | None, str, str, str, str], None]
"""(model, class, bucket, arm, reason) of each request :class:`SampledRouting` routed."""


class SampledRouting:
    """The gateway's :class:`~controller.gateway.routing.RoutingTable` in routing mode:
    per context the published :class:`Route`, sampled per request.

    A context the table does not hold (none published yet) goes to the off arm, where
    the policy starts every context. The arm names a pool by ``pool_by_arm``; an arm no
    pool runs goes to the off pool.
    """

    def __init__(
        self,
        pool_by_arm: Mapping[str, str],
        *,
        default_model: str | None,
        off_arm: str = "off",
        rng: random.Random | None = None,
        on_routed: OnRouted | None = None,
    ) -> None:
        if off_arm not in pool_by_arm:
            raise ValueError("routing mode needs a pool without speculation (the 'off' arm)")
        self.pool_by_arm = dict(pool_by_arm)
        self.default_model = default_model
        self.off_arm = off_arm
        self._routes: dict[tuple[str | None, str, str], _Entry] = {}
        self._random = (rng or random.Random()).random
        self.on_routed = on_routed

    def replace(self, routes: Mapping[RouteKey, Route]) -> None:
        """Route by ``routes`` from now on (one rebinding: a request sees the old table
        or the new one, never a mix)."""
        table = {}
        for key, route in routes.items():
            thresholds = []
            total = 0.0
            for arm, share, reason in route.explore:
                total += max(share, 0.0)
                thresholds.append((total, arm, reason))
            table[(key.model, key.workload_class, key.bucket)] = (
                route.arm,
                route.reason,
                tuple(thresholds),
            )
        self._routes = table

    def set_pools(self, pool_by_arm: Mapping[str, str]) -> None:
        if self.off_arm in pool_by_arm:
            self.pool_by_arm = dict(pool_by_arm)

    def pool_for(self, model: str | None, workload_class: str, bucket: str) -> str:
        model = model or self.default_model
        entry = self._routes.get((model, workload_class, bucket))
        if entry is None:
            arm, reason = self.off_arm, "learning"
        else:
            arm, reason, thresholds = entry
            if thresholds:
                draw = self._random()
                for threshold, other, why in thresholds:
                    if draw < threshold:
                        arm, reason = other, why
                        break
        if self.on_routed is not None:
            self.on_routed(model, workload_class, bucket, arm, reason)
        pools = self.pool_by_arm
        return pools.get(arm) or pools[self.off_arm]


def apply_pools(fleet: Fleet, pools: Mapping[str, tuple[str, tuple[str, ...]]]) -> bool:
    """Give the fleet's pools the snapshot's arms and instances (pools it does not know
    are ignored: a snapshot from settings since changed); True if any changed."""
    changed = False
    for name, (arm, urls) in pools.items():
        pool = fleet.pools.get(name)
        if pool is None:
            continue
        current = tuple(instance.base_url for instance in pool.instances)
        if pool.arm != arm or current != tuple(u.rstrip("/") for u in urls):
            fleet.set_instances(name, urls, arm)
            changed = True
    return changed
