"""Arms (what the policy can choose) and contexts (where it chooses).

An arm is a speculative configuration the fleet can actually serve: a proposer with a
number of draft tokens γ, or no speculation. Its text form is what the gateway, the
store and the API exchange: ``"ngram:4"``, ``"eagle3:5"``, ``"off"``.

A context is the unit a decision is made for: a model, a workload class and a
concurrency bucket. Buckets group concurrency levels that behave alike (decode stays
memory-bound at low concurrency, turns compute-bound at high); their lower edges are
configurable.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

OFF_NAME = "off"


@dataclass(frozen=True, slots=True)
class Arm:
    """A proposer and its speculation length γ; ``proposer=None`` (γ = 0) is no speculation."""

    proposer: str | None
    gamma: int

    def __post_init__(self) -> None:
        if self.proposer is None:
            if self.gamma != 0:
                raise ValueError("the off arm has gamma 0")
        elif self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 for proposer {self.proposer!r}")
        elif not self.proposer or ":" in self.proposer or self.proposer == OFF_NAME:
            raise ValueError(f"invalid proposer name {self.proposer!r}")

    @property
    def is_off(self) -> bool:
        return self.proposer is None

    @property
    def verify_tokens(self) -> int:
        """Positions the target verifies per sequence per step: γ drafts plus its own."""
        return self.gamma + 1

    def __str__(self) -> str:
        return OFF_NAME if self.proposer is None else f"{self.proposer}:{self.gamma}"

    @classmethod
    def parse(cls, text: str) -> Arm:
        """Inverse of ``str()``: ``"off"`` or ``"<proposer>:<γ>"``."""
        text = text.strip()
        if text == OFF_NAME:
            return OFF
        proposer, sep, gamma = text.rpartition(":")
        if not sep or not proposer:
            raise ValueError(f"arm {text!r} is neither 'off' nor 'proposer:gamma'")
        try:
            value = int(gamma)
        except ValueError:
            raise ValueError(f"arm {text!r}: gamma {gamma!r} is not an integer") from None
        return cls(proposer, value)


OFF = Arm(None, 0)


def sorted_arms(arms: Iterable[Arm]) -> tuple[Arm, ...]:
    """Distinct arms in a canonical order: off first, then by proposer and γ."""
    return tuple(
        sorted(set(arms), key=lambda a: (a.proposer is not None, a.proposer or "", a.gamma))
    )


def arms_from_proposers(gammas_by_proposer: Mapping[str, Iterable[int]]) -> tuple[Arm, ...]:
    """Every arm a fleet offers: off first, then each proposer's γ values in order."""
    arms = [OFF]
    for proposer, gammas in gammas_by_proposer.items():
        arms.extend(Arm(proposer, g) for g in gammas)
    return sorted_arms(arms)


@dataclass(frozen=True, slots=True)
class ConcurrencyBuckets:
    """Concurrency buckets by their inclusive lower edges, e.g. (1, 2, 4, 8, 16, 32).

    The default splits where decode behaviour changes on a typical GPU: alone, a
    handful, moderate, busy, and past the point where verification becomes
    compute-bound. The last bucket is open-ended ("32+").
    """

    lower_edges: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    _labels: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """:attr:`labels`, made once: the gateway labels every request's bucket."""

    def __post_init__(self) -> None:
        edges = self.lower_edges
        if not edges or edges[0] != 1:
            raise ValueError("bucket edges must start at 1")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"bucket edges must increase strictly: {edges}")
        object.__setattr__(self, "_labels", tuple(self.label(i) for i in range(len(edges))))

    def index(self, concurrency: int) -> int:
        """Bucket index for a concurrency (values below 1 count as 1)."""
        return max(0, bisect.bisect_right(self.lower_edges, max(1, concurrency)) - 1)

    def label(self, index: int) -> str:
        """``"1"``, ``"2-3"``, …, ``"32+"``: the form contexts and the API use."""
        low = self.lower_edges[index]
        if index == len(self.lower_edges) - 1:
            return f"{low}+"
        high = self.lower_edges[index + 1] - 1
        return str(low) if high == low else f"{low}-{high}"

    def bucket(self, concurrency: int) -> str:
        return self._labels[self.index(concurrency)]

    def upper(self, label: str) -> int | None:
        """The most concurrent requests a bucket holds; None where there is no bound
        (the open bucket, or a label not of these buckets)."""
        labels = self.labels
        if label not in labels:
            return None
        index = labels.index(label)
        if index == len(self.lower_edges) - 1:
            return None
        return self.lower_edges[index + 1] - 1

    @property
    def labels(self) -> tuple[str, ...]:
        return self._labels

    def representative(self, label: str) -> float:
        """A typical concurrency for a bucket, used before any has been observed there.

        The geometric middle of a closed bucket; 1.5 × the lower edge for the open one.
        """
        low = self.lower_edges[self.labels.index(label)]
        high = self.upper(label)
        if high is None:
            return 1.5 * low
        return float((low * high) ** 0.5)

    @classmethod
    def parse(cls, edges: Sequence[int] | str) -> ConcurrencyBuckets:
        """From a list or a comma-separated string of lower edges (``"1,2,4,8,16,32"``)."""
        if isinstance(edges, str):
            edges = [int(part) for part in edges.split(",") if part.strip()]
        return cls(tuple(int(e) for e in edges))


@dataclass(frozen=True, slots=True, order=True)
class Context:
    """Where a decision applies: model × workload class × concurrency bucket label."""

    model: str
    workload_class: str
    bucket: str

    def __str__(self) -> str:
        return f"{self.model}/{self.workload_class}/{self.bucket}"
