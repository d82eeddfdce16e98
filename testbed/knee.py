"""Does speculation pay at low load and cost at high load on this machine's testbed?

``specpilot testbed knee [--batch-tokens N ...] [--temperature T ...] [--json]`` starts
an off and an n-gram γ=4 server side by side (per budget) and runs the same closed-loop
code traffic against both at one and at sixteen streams (per sampling temperature),
interleaved off / n-gram / n-gram / off so that background load on a shared machine
falls on both alike. It prints n-gram's goodput
over off's at each load and the tokens per verify step. ``testbed.server.KNEE_TOKENS``
was chosen with it; docs/testbed.md has the figures.
"""

from __future__ import annotations

import asyncio
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
    temperature: float
    streams: int
    off_tokens_per_s: float
    ngram_tokens_per_s: float
    tokens_per_step: float | None
    """Mean tokens n-gram emitted per verify step (1 + accepted per draft)."""

    @property
    def ngram_over_off(self) -> float:
        return self.ngram_tokens_per_s / self.off_tokens_per_s


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
) -> list[KneePoint]:
    with (
        VllmServer(env, models, None, batch_tokens=batch_tokens) as off,
        VllmServer(env, models, parse_spec("ngram:4", models), batch_tokens=batch_tokens) as ngram,
    ):
        urls = {"off": off.base_url, "ngram": ngram.base_url}
        for url in urls.values():  # first requests pay one-off warm-up costs
            asyncio.run(run_streams(url, 2, 2, max_tokens=max_tokens, seed=10_000))
        points = []
        for temperature in temperatures:
            for streams, each in LOADS:
                tokens = dict.fromkeys(urls, 0)
                seconds = dict.fromkeys(urls, 0.0)
                drafts_before, accepted_before = _spec_counters(ngram.base_url)
                for name in ("off", "ngram", "ngram", "off"):
                    started = time.perf_counter()
                    traffic = run_streams(
                        urls[name],
                        streams,
                        each,
                        max_tokens=max_tokens,
                        seed=streams,
                        mix=(("code", temperature),),
                    )
                    tokens[name] += asyncio.run(traffic)
                    seconds[name] += time.perf_counter() - started
                drafts, accepted = _spec_counters(ngram.base_url)
                steps = drafts - drafts_before
                points.append(
                    KneePoint(
                        batch_tokens,
                        temperature,
                        streams,
                        tokens["off"] / seconds["off"],
                        tokens["ngram"] / seconds["ngram"],
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
            f"budget {budget:18s} temperature {p.temperature:.2f} streams {p.streams:2d}: "
            f"off {p.off_tokens_per_s:7.1f} tok/s, "
            f"ngram:4 {p.ngram_tokens_per_s:7.1f} tok/s, ngram/off {p.ngram_over_off:.2f}, "
            f"tokens/step {per_step}"
        )
    return "\n".join(lines)


def as_json(points: list[KneePoint]) -> str:
    return json.dumps([{**asdict(p), "ngram_over_off": p.ngram_over_off} for p in points])
