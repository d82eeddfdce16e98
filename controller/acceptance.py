"""Acceptance as specpilot shows it: vLLM's figure, from the evidence the loop sees.

vLLM's acceptance is accepted draft tokens over draft tokens
(``vllm:spec_decode_num_accepted_tokens_total`` over
``vllm:spec_decode_num_draft_tokens_total``). Here it is summed over the evidence of one
model × workload class × proposer: scraped ``/metrics`` windows (their counters'
increases) or finished requests (their ``metrics.speculative_decoding`` counts). Every
place an operator reads "acceptance" (``/v1/policy``, ``specpilot_acceptance_ratio``,
``specpilot_context_acceptance_ratio``, ``AcceptanceDrift``'s messages) reads it here.

Evidence that drafted nothing while a proposer was configured (n-gram finds no match
in prose, so it proposes nothing) has no acceptance: it is "drafted nothing", shown as
such (``drafted_nothing``), never as acceptance 0.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from collectors.observations import RequestObservation, WindowObservation
from policies.arms import Arm

EVIDENCE_KEPT = 512
"""Drafted windows or requests kept per model × class × proposer."""
RECENT_DRAFT_TOKENS = 500.0
""""Recent" acceptance: the newest evidence that adds up to this many draft tokens
(one busy window, a few quiet ones, or a handful of requests)."""

Key = tuple[str, str, str]
"""(model, workload class, proposer)."""


@dataclass(frozen=True, slots=True)
class Evidence:
    """One window or request that drafted: vLLM's counts over ``[since, until]``."""

    since: float
    until: float
    arm: str
    accepted: float
    draft_tokens: float
    drafts: float


@dataclass(frozen=True, slots=True)
class Acceptance:
    """vLLM's acceptance over a stretch of evidence."""

    accepted: float
    draft_tokens: float
    drafts: float
    since: float
    until: float

    @property
    def ratio(self) -> float:
        return min(1.0, self.accepted / self.draft_tokens)

    @property
    def tokens_per_verify(self) -> float:
        """vLLM's emitted tokens per verify step: 1 + accepted / drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else 1.0

    def describe(self) -> str:
        return (
            f"{self.ratio:.2f} ({self.accepted:.0f} of {self.draft_tokens:.0f} draft tokens "
            f"accepted, {self.tokens_per_verify:.2f} tokens per verify step, "
            f"{_utc(self.since)} to {_utc(self.until)})"
        )


def summed(items: Sequence[Evidence]) -> Acceptance | None:
    """Accepted over draft tokens summed over ``items``, as vLLM's counters sum them."""
    if not items:
        return None
    return Acceptance(
        accepted=sum(e.accepted for e in items),
        draft_tokens=sum(e.draft_tokens for e in items),
        drafts=sum(e.drafts for e in items),
        since=min(e.since for e in items),
        until=max(e.until for e in items),
    )


@dataclass(slots=True)
class AcceptanceTrack:
    """The drafted evidence of one model × class × proposer, newest last, and whether
    the newest evidence drafted at all."""

    evidence: deque[Evidence] = field(default_factory=lambda: deque(maxlen=EVIDENCE_KEPT))
    newest_arm: str | None = None
    drafted_nothing_since: float | None = None
    """While the newest evidence drafted nothing: the end of the last that drafted
    (or of the first that did not, if none ever did). None otherwise."""

    def add(self, item: Evidence) -> None:
        self.evidence.append(item)
        self.newest_arm = item.arm
        self.drafted_nothing_since = None

    def nothing_drafted(self, arm: str, at: float) -> None:
        if self.drafted_nothing_since is None:
            self.drafted_nothing_since = self.evidence[-1].until if self.evidence else at
        self.newest_arm = arm

    @property
    def drafted_nothing(self) -> bool:
        return self.drafted_nothing_since is not None

    def recent(self, arm: str | None = None, after: float = -math.inf) -> Acceptance | None:
        """Acceptance over the newest evidence (of ``arm``, ending after ``after``) that
        adds up to ``RECENT_DRAFT_TOKENS`` draft tokens, or over all of it if less."""
        taken: list[Evidence] = []
        tokens = 0.0
        for item in reversed(self.evidence):
            if item.until <= after:
                break
            if arm is not None and item.arm != arm:
                continue
            taken.append(item)
            tokens += item.draft_tokens
            if tokens >= RECENT_DRAFT_TOKENS:
                break
        return summed(taken)

    def fall(self, after: float = -math.inf) -> tuple[Acceptance, Acceptance] | None:
        """(before, after) around the likeliest point where acceptance fell, among the
        evidence ending after ``after``: the split that maximises the fall weighted by
        the draft tokens on both sides (a two-sample statistic), so one odd window
        cannot make it. None without two pieces of evidence or without any fall."""
        items = [e for e in self.evidence if e.until > after]
        if len(items) < 2:
            return None
        total_accepted = sum(e.accepted for e in items)
        total_tokens = sum(e.draft_tokens for e in items)
        best: tuple[float, int] | None = None
        accepted = tokens = 0.0
        for k in range(1, len(items)):
            accepted += items[k - 1].accepted
            tokens += items[k - 1].draft_tokens
            rest = total_tokens - tokens
            drop = accepted / tokens - (total_accepted - accepted) / rest
            score = drop * math.sqrt(tokens * rest / total_tokens)
            if best is None or score > best[0]:
                best = (score, k)
        if best is None or best[0] <= 0:
            return None
        before, later = summed(items[: best[1]]), summed(items[best[1] :])
        assert before is not None and later is not None
        return before, later


class AcceptanceBook:
    """Every model × class × proposer's track, fed by the loop with the evidence the
    policy learns from."""

    def __init__(self) -> None:
        self.tracks: dict[Key, AcceptanceTrack] = {}

    def note_window(self, window: WindowObservation) -> Key | None:
        """Take a window's counts; the key it was for, None where it is no evidence of
        a proposer (off, an arm that does not parse, nothing generated)."""
        proposer = _proposer(window.arm)
        if proposer is None or window.generation_tokens <= 0:
            return None
        key = (window.model, window.workload_class or "", proposer)
        track = self.tracks.setdefault(key, AcceptanceTrack())
        arm = window.arm or ""
        if window.drafts > 0 and window.draft_tokens > 0:
            track.add(
                Evidence(
                    since=window.started_at,
                    until=window.finished_at,
                    arm=arm,
                    accepted=window.accepted_tokens,
                    draft_tokens=window.draft_tokens,
                    drafts=window.drafts,
                )
            )
        else:
            track.nothing_drafted(arm, window.finished_at)
        return key

    def note_request(self, observation: RequestObservation) -> Key | None:
        """Take a finished request's counts (where vLLM reported them)."""
        proposer = _proposer(observation.arm)
        spec = observation.spec
        if proposer is None or spec is None or spec.num_drafts is None:
            return None
        key = (observation.model or "", observation.workload_class or "", proposer)
        track = self.tracks.setdefault(key, AcceptanceTrack())
        arm = observation.arm or ""
        until = observation.finished_at if observation.finished_at is not None else 0.0
        since = until - (observation.generation_time_s or 0.0)
        if spec.num_drafts == 0:
            track.nothing_drafted(arm, until)
            return key
        accepted = spec.num_accepted_tokens
        if accepted is None and spec.accepted_per_position is not None:
            accepted = sum(spec.accepted_per_position)
        if accepted is None or not spec.num_draft_tokens:
            return None  # drafted, but vLLM did not say how much: no acceptance to read
        tokens, drafts = float(spec.num_draft_tokens), float(spec.num_drafts)
        track.add(Evidence(since, until, arm, float(accepted), tokens, drafts))
        return key

    def track(self, key: Key) -> AcceptanceTrack | None:
        return self.tracks.get(key)

    def of_arm(self, model: str, workload_class: str, arm: str) -> ArmAcceptance:
        """What the evidence says of ``arm`` for a model × class (nothing for off)."""
        proposer = _proposer(arm)
        track = self.tracks.get((model, workload_class, proposer)) if proposer else None
        if track is None:
            return ArmAcceptance(None, None)
        drafted_nothing = track.drafted_nothing if track.newest_arm == arm else None
        return ArmAcceptance(track.recent(arm), drafted_nothing)


@dataclass(frozen=True, slots=True)
class ArmAcceptance:
    acceptance: Acceptance | None
    """vLLM's acceptance over the arm's recent drafted evidence; None without any."""
    drafted_nothing: bool | None
    """Whether the newest evidence of the class × proposer, run on this arm, drafted
    nothing; None where the newest evidence ran another arm, or there is none."""


def _proposer(arm: str | None) -> str | None:
    try:
        return Arm.parse(arm).proposer if arm else None
    except ValueError:
        return None


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
