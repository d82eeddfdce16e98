"""What the gateway measured per instance: the requests it relayed to each one over the
last ``window_s``, summed as vLLM's own ``/metrics`` window would sum them.

In routing mode the gateway is the evidence (nothing scrapes ``/metrics`` unless
``collect`` lists ``scrape``), so this is what ``GET /v1/fleet`` shows per instance:
requests, vLLM's acceptance (accepted over draft tokens, from each response's
``metrics.speculative_decoding``), tokens per verify step, and the latencies the
requests reported and the client waited. Kept by the leader's loop, which takes in
every replica's gateway observations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from collectors.observations import RequestObservation

WINDOW_S = 60.0
"""The window a relayed-requests figure covers (wall seconds up to now)."""
MAX_REQUESTS = 4096
"""Requests kept per instance at most: past it, the window is the newest ones."""


@dataclass(frozen=True, slots=True)
class RelayedWindow:
    """The requests relayed to one instance over ``window_s`` seconds up to ``until``."""

    pool: str
    instance: str
    arm: str | None
    """The arm of the pool that served the newest of them."""
    window_s: float
    until: float
    requests: int
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    drafts: int
    tpot_s: float | None
    """Mean time per output token after the first, as vLLM reported each request."""
    ttft_s: float | None
    e2e_s: float | None
    """Mean time the client waited, as the gateway measured it."""
    last_request_at: float

    @property
    def acceptance_rate(self) -> float | None:
        """vLLM's acceptance: accepted over draft tokens; None where nothing drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: 1 + accepted / drafts; None without drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None


class RelayedWindows:
    """Per (pool, instance): the requests relayed there recently."""

    def __init__(self, window_s: float = WINDOW_S, max_requests: int = MAX_REQUESTS) -> None:
        self.window_s = window_s
        self._max = max_requests
        self._seen: dict[tuple[str, str], deque[RequestObservation]] = {}

    def add(self, observations: Iterable[RequestObservation]) -> None:
        """Take in observations; those no gateway relayed (no instance) are not its."""
        for observation in observations:
            if observation.pool is None or observation.instance is None:
                continue
            if observation.finished_at is None:
                continue
            key = (observation.pool, observation.instance)
            kept = self._seen.get(key)
            if kept is None:
                kept = self._seen[key] = deque(maxlen=self._max)
            kept.append(observation)

    def window(self, pool: str, instance: str, now: float) -> RelayedWindow | None:
        """The instance's window up to ``now``; None when nothing was relayed to it in
        it (what it was relayed before is dropped)."""
        kept = self._seen.get((pool, instance))
        if kept is None:
            return None
        since = now - self.window_s
        while kept and (kept[0].finished_at or 0.0) < since:
            kept.popleft()
        if not kept:
            del self._seen[(pool, instance)]
            return None
        tokens = draft = accepted = drafts = 0
        tpot: list[float] = []
        ttft: list[float] = []
        e2e: list[float] = []
        for observation in kept:
            tokens += observation.output_tokens or 0
            spec = observation.spec
            if spec is not None and spec.num_draft_tokens and spec.num_accepted_tokens is not None:
                draft += spec.num_draft_tokens
                accepted += spec.num_accepted_tokens
                drafts += spec.num_drafts or 0
            if observation.tpot_s is not None:
                tpot.append(observation.tpot_s)
            if observation.ttft_s is not None:
                ttft.append(observation.ttft_s)
            if observation.e2e_s is not None:
                e2e.append(observation.e2e_s)
        covered = self.window_s
        if len(kept) == kept.maxlen:  # the newest requests only: what they span
            covered = max(now - (kept[0].finished_at or now), 0.0)
        return RelayedWindow(
            pool=pool,
            instance=instance,
            arm=kept[-1].arm,
            window_s=covered,
            until=now,
            requests=len(kept),
            output_tokens=tokens,
            draft_tokens=draft,
            accepted_tokens=accepted,
            drafts=drafts,
            tpot_s=_mean(tpot),
            ttft_s=_mean(ttft),
            e2e_s=_mean(e2e),
            last_request_at=kept[-1].finished_at or now,
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
