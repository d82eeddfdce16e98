"""Scenario files: the fleet, its traffic and how both change over time.

A scenario is YAML (or the equivalent dict)::

    seed: 1                      # default 0: seeds all traffic
    duration_s: 1800             # default 3600: simulated seconds
    model: {step_ms: 30, knee_tokens: 64}
    proposers:
      eagle3: {draft_cost: 0.05, gammas: [1, 2, 3, 4, 5, 6, 8]}
      ngram:  {draft_cost: 0.005, gammas: [2, 3, 4, 5]}
    classes:
      code: {share: 0.6, output_tokens: 256, acceptance: {eagle3: 0.82, ngram: 0.55}}
      chat: {share: 0.4, output_tokens: 384, acceptance: {eagle3: 0.7, ngram: 0.15}}
    phases:                      # closed loop: this many streams from at_s on
      - {at_s: 0, concurrency: 2}
      - {at_s: 600, concurrency: 48}
    drift:                       # from at_s on, that class × proposer acceptance becomes this
      - {at_s: 900, class: code, proposer: eagle3, acceptance: 0.4}

Defaults for missing keys (all documented on the fields below): ``model`` name
``sim-model``, ``step_ms`` 30, ``knee_tokens`` 64, ``position_decay`` 0.97,
``acceptance_concentration`` 20; a proposer's ``draft_cost`` 0.05 and ``gammas``
[1, 2, 3, 4, 5]; a class's ``output_tokens`` 256, ``output_spread`` 0.5 and, for a
proposer it does not list, acceptance 0 (that proposer never helps it); ``phases`` one
stream from 0 s; no ``drift``. Unknown keys are rejected, as are unknown proposers,
class shares not summing to 1 and acceptances outside [0, 1]; every message names the
offending key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from policies.arms import Arm, arms_from_proposers
from policies.fleet import CostParams

_SHARE_TOLERANCE = 1e-6


class ScenarioError(ValueError):
    """A scenario file that cannot be simulated; the message names every bad key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Strict):
    name: str = "sim-model"
    """Model name reported in observations and contexts."""
    step_ms: float = Field(30.0, gt=0)
    """A plain decode step at batch 1 (memory-bound), milliseconds."""
    knee_tokens: float = Field(64.0, gt=0)
    """Verified positions per step past which a step turns compute-bound."""
    position_decay: float = Field(0.97, gt=0, le=1)
    """Draft position i is accepted (given the earlier ones were) with α × decay^i."""
    acceptance_concentration: float = Field(20.0, gt=0)
    """Per-request α ~ Beta(κα, κ(1-α)) around the class mean: requests differ."""


class ProposerSpec(_Strict):
    draft_cost: float = Field(0.05, ge=0)
    """One draft position's time as a fraction of a plain decode step."""
    gammas: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5], min_length=1)
    """Speculation lengths the fleet can serve with this proposer."""

    @model_validator(mode="after")
    def _positive_gammas(self) -> ProposerSpec:
        if any(g < 1 for g in self.gammas):
            raise ValueError(f"gammas must all be >= 1, got {self.gammas}")
        return self


class ClassSpec(_Strict):
    share: float = Field(gt=0, le=1)
    """Fraction of requests of this class."""
    output_tokens: int = Field(256, ge=2)
    """Mean generated tokens per request."""
    output_spread: float = Field(0.5, ge=0, lt=1)
    """Output length is uniform in output_tokens × [1 - spread, 1 + spread]."""
    acceptance: dict[str, float] = Field(default_factory=dict)
    """Mean per-token acceptance α per proposer, in [0, 1]."""


class Phase(_Strict):
    at_s: float = Field(ge=0)
    concurrency: int = Field(ge=0)


class Drift(_Strict):
    at_s: float = Field(ge=0)
    workload_class: str = Field(alias="class")
    proposer: str
    acceptance: float


class Scenario(_Strict):
    seed: int = 0
    duration_s: float = Field(3600.0, gt=0)
    model: ModelSpec = Field(default_factory=ModelSpec)  # type: ignore[arg-type]
    proposers: dict[str, ProposerSpec] = Field(min_length=1)
    classes: dict[str, ClassSpec] = Field(min_length=1)
    phases: list[Phase] = Field(default_factory=lambda: [Phase(at_s=0, concurrency=1)])
    drift: list[Drift] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        problems: list[str] = []
        for name in self.proposers:
            if name == "off" or ":" in name or not name:
                problems.append(f"proposers.{name}: reserved or invalid proposer name")
        total = sum(c.share for c in self.classes.values())
        if not math.isclose(total, 1.0, abs_tol=_SHARE_TOLERANCE):
            problems.append(f"classes.*.share: shares sum to {total:g}, not 1")
        for cls, spec in self.classes.items():
            for proposer, alpha in spec.acceptance.items():
                key = f"classes.{cls}.acceptance.{proposer}"
                if proposer not in self.proposers:
                    problems.append(f"{key}: unknown proposer {proposer!r} ({self._known()})")
                if not 0.0 <= alpha <= 1.0:
                    problems.append(f"{key}: acceptance {alpha} is outside [0, 1]")
        if not self.phases:
            problems.append("phases: at least one phase is needed")
        elif any(b.at_s <= a.at_s for a, b in zip(self.phases, self.phases[1:], strict=False)):
            problems.append("phases: at_s must increase strictly")
        for i, event in enumerate(self.drift):
            key = f"drift[{i}]"
            if event.workload_class not in self.classes:
                problems.append(f"{key}.class: unknown class {event.workload_class!r}")
            if event.proposer not in self.proposers:
                problems.append(f"{key}.proposer: unknown proposer {event.proposer!r}")
            if not 0.0 <= event.acceptance <= 1.0:
                problems.append(f"{key}.acceptance: {event.acceptance} is outside [0, 1]")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _known(self) -> str:
        return "known: " + ", ".join(sorted(self.proposers))

    # -- derived views -------------------------------------------------------------

    @property
    def arms(self) -> tuple[Arm, ...]:
        """Every arm the fleet can serve, off first."""
        return arms_from_proposers({p: s.gammas for p, s in self.proposers.items()})

    @property
    def cost(self) -> CostParams:
        return CostParams(
            step_s=self.model.step_ms / 1000.0,
            knee_tokens=self.model.knee_tokens,
            draft_cost={p: s.draft_cost for p, s in self.proposers.items()},
        )

    def phase_at(self, t: float) -> int:
        """Index of the phase in force at time t (the first one before it starts)."""
        index = 0
        for i, phase in enumerate(self.phases):
            if phase.at_s <= t:
                index = i
        return index

    def concurrency_at(self, t: float) -> int:
        if t < self.phases[0].at_s:
            return 0
        return self.phases[self.phase_at(t)].concurrency

    def acceptance_at(self, workload_class: str, proposer: str, t: float) -> float:
        """Mean α of a class × proposer at time t, after every drift event up to t."""
        alpha = self.classes[workload_class].acceptance.get(proposer, 0.0)
        for event in sorted(self.drift, key=lambda e: e.at_s):
            if (
                event.at_s <= t
                and event.workload_class == workload_class
                and event.proposer == proposer
            ):
                alpha = event.acceptance
        return alpha

    def phase_end(self, index: int) -> float:
        if index + 1 < len(self.phases):
            return min(self.phases[index + 1].at_s, self.duration_s)
        return self.duration_s


def parse_scenario(data: Any) -> Scenario:
    """Validate a scenario dict; raises :class:`ScenarioError` naming each bad key."""
    if not isinstance(data, dict):
        raise ScenarioError("scenario: expected a mapping at the top level")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        messages = []
        for error in exc.errors():
            location = ".".join(str(part) for part in error["loc"])
            message = str(error["msg"]).removeprefix("Value error, ")
            messages.append(f"{location}: {message}" if location else message)
        raise ScenarioError("invalid scenario: " + "; ".join(messages)) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    return parse_scenario(data)
