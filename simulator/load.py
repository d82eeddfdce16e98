"""A closed-loop load generator: a scenario's streams of requests against a URL.

Each stream sends one request, waits for its answer, sends the next — the closed loop
of the scenario's ``phases`` (stream i is active while the phase's concurrency exceeds
i). The scenario's time line runs ``speed`` times faster than the wall clock, like the
simulated fleet's, so the phases of a half-hour scenario pass in minutes. Requests go
to one base URL (a gateway or an instance) over the OpenAI API and declare their class
(header ``X-Workload-Class`` and ``metadata.workload_class``) unless told not to, so a
classifier on the way can be tested too.

It stops by itself: after ``max_requests`` requests, after ``max_duration_s`` wall
seconds (in-flight requests are then abandoned) or at the scenario's end, whichever
comes first.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from collectors.observations import RequestObservation
from collectors.per_request import observation_from_response, observation_from_stream
from simulator.scenario import Scenario

WORKLOAD_CLASS_HEADER = "X-Workload-Class"

_PROMPTS: dict[str, str] = {
    "code": "Complete this function:\n```python\ndef parse_rows(lines):\n    rows = []\n",
    "json": 'Return a JSON object {"name": str, "tags": [str]} for this product: ',
    "structured": 'Fill in the JSON record {"id": int, "status": str} for: ',
    "rag": "Using only the documents below, answer the question.\n\nDocuments:\n",
    "edit": "Rewrite the following paragraph, fixing grammar only:\n",
    "creative": "Write a short story about a lighthouse keeper who finds a map.",
    "chat": "Hi! What is a good way to learn a new language?",
}
"""A representative prompt per usual class name; other classes get a neutral one."""


def prompt_for(workload_class: str) -> str:
    return _PROMPTS.get(workload_class, f"Please help with this {workload_class} task.")


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One answered request: its declared class and what its response reported."""

    workload_class: str
    observation: RequestObservation | None
    """None when the response carried no metrics (a stream without usage)."""


@dataclass(slots=True)
class LoadReport:
    """What a load run did. Times are wall seconds."""

    sent: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    stopped_by: str = ""
    """``max_requests``, ``max_duration`` or ``scenario_end``."""
    results: list[LoadResult] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return len(self.results)

    @property
    def by_class(self) -> dict[str, int]:
        return dict(Counter(r.workload_class for r in self.results))

    @property
    def output_tokens(self) -> int:
        return sum(
            r.observation.output_tokens or 0 for r in self.results if r.observation is not None
        )

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed": self.failed,
            "output_tokens": self.output_tokens,
            "by_class": self.by_class,
            "elapsed_s": self.elapsed_s,
            "stopped_by": self.stopped_by,
        }


@dataclass(frozen=True, slots=True)
class LoadOptions:
    speed: float = 1.0
    """Scenario seconds per wall second (match the fleet's)."""
    max_requests: int = 1000
    max_duration_s: float = 60.0
    """Wall seconds."""
    chat: bool = False
    """Use /v1/chat/completions instead of /v1/completions."""
    stream: bool = False
    declare_class: bool = True
    max_tokens: int | None = None
    """None: let each request run to its class's natural length."""
    timeout_s: float = 120.0


class _Budget:
    """The shared request count: streams take a ticket before each request."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def run_load(
    base_url: str,
    scenario: Scenario,
    options: LoadOptions,
    *,
    rng: random.Random,
    client: httpx.AsyncClient | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> LoadReport:
    """Drive the scenario's closed-loop streams against ``base_url`` until a bound."""
    if options.speed <= 0:
        raise ValueError("speed must be > 0")
    own_client = client is None
    http = client or httpx.AsyncClient(timeout=options.timeout_s)
    report = LoadReport()
    budget = _Budget(options.max_requests)
    start = clock()
    deadline = start + min(options.max_duration_s, scenario.duration_s / options.speed)
    classes = list(scenario.classes)
    weights = [scenario.classes[c].share for c in classes]
    streams = max(p.concurrency for p in scenario.phases)
    # One generator per stream, seeded from the caller's, so the class sequence of each
    # stream does not depend on how responses interleave.
    stream_rngs = [random.Random(rng.getrandbits(64)) for _ in range(streams)]

    def sim_now() -> float:
        return (clock() - start) * options.speed

    async def wait_until_active(index: int) -> bool:
        """Sleep until this stream's phase is on; False if that is past the deadline."""
        while scenario.concurrency_at(sim_now()) <= index:
            now = sim_now()
            opens = [p.at_s for p in scenario.phases if p.at_s > now and p.concurrency > index]
            if not opens:
                return False
            wake = start + min(opens) / options.speed
            if wake >= deadline:
                return False
            await asyncio.sleep(max(0.0, wake - clock()))
        return True

    async def stream(index: int) -> None:
        own_rng = stream_rngs[index]
        while clock() < deadline and await wait_until_active(index):
            if not budget.take():
                return
            workload_class = own_rng.choices(classes, weights)[0]
            report.sent += 1
            try:
                observation = await _send(http, base_url, workload_class, options)
            except (httpx.HTTPError, ValueError):
                report.failed += 1
                continue
            report.results.append(LoadResult(workload_class, observation))

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - clock()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        if own_client:
            await http.aclose()
    report.elapsed_s = clock() - start
    if budget.left <= 0:
        report.stopped_by = "max_requests"
    elif pending and options.max_duration_s < scenario.duration_s / options.speed:
        report.stopped_by = "max_duration"
    else:
        report.stopped_by = "scenario_end"  # its end came, or no phase has streams left
    return report


async def _send(
    http: httpx.AsyncClient, base_url: str, workload_class: str, options: LoadOptions
) -> RequestObservation | None:
    """One request; its observation from the response's metrics (None if it had none)."""
    prompt = prompt_for(workload_class)
    body: dict[str, Any]
    if options.chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt}
    if options.max_tokens is not None:
        body["max_tokens"] = options.max_tokens
    headers = {}
    if options.declare_class:
        body["metadata"] = {"workload_class": workload_class}
        headers[WORKLOAD_CLASS_HEADER] = workload_class
    url = base_url.rstrip("/") + path
    if not options.stream:
        response = await http.post(url, json=body, headers=headers)
        response.raise_for_status()
        return observation_from_response(response.content)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        lines = [line async for line in response.aiter_lines()]
    return observation_from_stream(lines)
