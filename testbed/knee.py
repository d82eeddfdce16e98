"""Does speculation pay at low load and cost at high load on this machine's testbed?

``specpilot testbed knee [--batch-tokens N ...] [--temperature T ...] [--workload CLASS
...] [--spec SPEC] [--json]`` starts an off and a speculating server (``--spec``, default
n-gram γ=4) side by side (per budget) and runs the same closed-loop traffic of one
workload class against both at one and at sixteen streams (per class and sampling
temperature), interleaved off / spec / spec / off so that background load on a shared
machine falls on both alike. It prints the speculating server's goodput over off's at
each load and its tokens per verify step. ``testbed.server.KNEE_TOKENS``
was chosen with it; docs/testbed.md has the figures.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass

import httpx

from collectors.exposition import parse_exposition
from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer, parse_spec
from testbed.traffic import run_streams

LOADS = ((1, 8), (16, 2))
"""(streams, requests per stream) per load level."""


@dataclass(frozen=True)
class KneePoint:
    batch_tokens: int | None
    spec: str
    workload: str
    temperature: float
    streams: int
    off_tokens_per_s: float
    spec_tokens_per_s: float
    tokens_per_step: float | None
    """Mean tokens the speculating server emitted per verify step (1 + accepted per draft)."""

    @property
    def spec_over_off(self) -> float:
        return self.spec_tokens_per_s / self.off_tokens_per_s


def _spec_counters(base_url: str) -> tuple[float, float]:
    """(drafts, accepted tokens) so far, from the server's /metrics."""
    page = parse_exposition(httpx.get(f"{base_url}/metrics", timeout=10.0).text)
    counters = [e.spec for e in page.engines.values() if e.spec is not None]
    return (
        sum(c.drafts for c in counters),
        sum(c.accepted_tokens for c in counters),
    )


def measure(
    env: VllmEnvironment,
    models: ModelSet,
    batch_tokens: int | None,
    max_tokens: int = 48,
    temperatures: tuple[float, ...] = (0.0,),
    workloads: tuple[str, ...] = ("code",),
    spec: str = "ngram:4",
) -> list[KneePoint]:
    with (
        VllmServer(env, models, None, batch_tokens=batch_tokens) as off,
        VllmServer(env, models, parse_spec(spec, models), batch_tokens=batch_tokens) as speculating,
    ):
        urls = {"off": off.base_url, "spec": speculating.base_url}
        for url in urls.values():  # first requests pay one-off warm-up costs
            asyncio.run(run_streams(url, 2, 2, max_tokens=max_tokens, seed=10_000))
        points = []
        for workload, temperature in itertools.product(workloads, temperatures):
            for streams, each in LOADS:
                tokens = dict.fromkeys(urls, 0)
                seconds = dict.fromkeys(urls, 0.0)
                drafts_before, accepted_before = _spec_counters(speculating.base_url)
                for name in ("off", "spec", "spec", "off"):
                    started = time.perf_counter()
                    traffic = run_streams(
                        urls[name],
                        streams,
                        each,
                        max_tokens=max_tokens,
                        seed=streams,
                        mix=((workload, temperature),),
                    )
                    tokens[name] += asyncio.run(traffic)
                    seconds[name] += time.perf_counter() - started
                drafts, accepted = _spec_counters(speculating.base_url)
                steps = drafts - drafts_before
                points.append(
                    KneePoint(
                        batch_tokens,
                        spec,
                        workload,
                        temperature,
                        streams,
                        tokens["off"] / seconds["off"],
                        tokens["spec"] / seconds["spec"],
                        1 + (accepted - accepted_before) / steps if steps else None,
                    )
                )
        return points


def report(points: list[KneePoint]) -> str:
    lines = []
    for p in points:
        budget = "vLLM default" if p.batch_tokens is None else f"{p.batch_tokens} tokens/step"
        per_step = f"{p.tokens_per_step:.2f}" if p.tokens_per_step is not None else "n/a"
        lines.append(
            f"budget {budget:18s} {p.workload:8s} temperature {p.temperature:.2f} "
            f"streams {p.streams:2d}: off {p.off_tokens_per_s:7.1f} tok/s, "
            f"{p.spec} {p.spec_tokens_per_s:7.1f} tok/s, {p.spec}/off {p.spec_over_off:.2f}, "
            f"tokens/step {per_step}"
        )
    return "\n".join(lines)


def as_json(points: list[KneePoint]) -> str:
    return json.dumps([{**asdict(p), "spec_over_off": p.spec_over_off} for p in points])
