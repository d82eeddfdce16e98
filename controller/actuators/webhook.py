"""POST each pool's effective ``--speculative-config`` to a webhook, with retries.

One request per pool, body::

    {"pool": "chat", "speculative_config": {...} | null,
     "arms_by_bucket": {"1": "ngram:4", ...}, "idempotency_key": "<hex>"}

also sent as the ``Idempotency-Key`` header. The key is a hash of the pool and the
config, so the same decision always carries the same key — across retries, across the
loop handing the pool over again, across specpilot restarts — and a receiver can drop
duplicates without keeping state of its own.

Connection errors, timeouts, 408, 425, 429 and 5xx are retried with bounded exponential
back-off and full jitter (``min(max_delay, base · 2^attempt) · U(0, 1]``, RNG injected);
any other answer is final. A pool that still fails raises ``WebhookFailed``, which the
loop records as an alert; it hands the pool over again at the next iteration.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from controller.actuators.preflight import Preflight
from controller.fleet import PoolConfig

RETRYABLE_STATUS: frozenset[int] = frozenset({408, 425, 429, 500, 502, 503, 504})
Sleep = Callable[[float], Awaitable[None]]


def idempotency_key(config: PoolConfig) -> str:
    """Same pool and config → same key (SHA-256 of their canonical JSON)."""
    canonical = json.dumps([config.pool, config.config], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def payload(config: PoolConfig) -> dict[str, Any]:
    return {
        "pool": config.pool,
        "speculative_config": config.config,
        "arms_by_bucket": dict(config.arms_by_bucket),
        "idempotency_key": idempotency_key(config),
    }


@dataclass(frozen=True, slots=True)
class RetrySettings:
    attempts: int = 5
    """Tries per pool, the first included."""
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    timeout_s: float = 10.0
    """Per attempt."""

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds before retry number ``retry`` (0-based), full jitter."""
        ceiling = min(self.max_delay_s, self.base_delay_s * 2.0**retry)
        return ceiling * (1.0 - rng.random())  # (0, ceiling]: never a hot retry


class WebhookFailed(RuntimeError):
    """The webhook did not take one or more pools' configs; the message says why."""


@dataclass
class WebhookActuator:
    url: str
    retry: RetrySettings = field(default_factory=RetrySettings)
    headers: dict[str, str] = field(default_factory=dict)
    """Sent with every request (e.g. an ``Authorization`` header)."""
    preflight: Preflight = field(default_factory=Preflight)
    rng: random.Random = field(default_factory=random.Random)
    sleep: Sleep = asyncio.sleep
    transport: httpx.AsyncBaseTransport | None = None
    name: str = "webhook"

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        for config in configs:  # all refused before any is sent
            self.preflight.check(config)
        errors = []
        async with httpx.AsyncClient(
            timeout=self.retry.timeout_s, transport=self.transport
        ) as client:
            for config in configs:
                error = await self._post(client, config)
                if error is not None:
                    errors.append(f"pool {config.pool!r}: {error}")
        if errors:
            raise WebhookFailed(f"{self.url}: " + "; ".join(errors))

    async def _post(self, client: httpx.AsyncClient, config: PoolConfig) -> str | None:
        """None once the webhook took it, else the last error."""
        body = payload(config)
        headers = {**self.headers, "Idempotency-Key": body["idempotency_key"]}
        error = "no attempt made"
        for attempt in range(self.retry.attempts):
            if attempt:
                await self.sleep(self.retry.delay(attempt - 1, self.rng))
            try:
                response = await client.post(self.url, json=body, headers=headers)
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}"
                continue
            if response.is_success:
                return None
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code not in RETRYABLE_STATUS:
                return error
        return f"{error} (after {self.retry.attempts} attempts)"
