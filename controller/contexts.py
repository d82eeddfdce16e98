"""Contexts: the unit a decision is made for (model × workload class × concurrency bucket).

Mirrors ``policies.arms.Context`` and ``ConcurrencyBuckets`` field for field (same
labels: ``"1"``, ``"2-3"``, …, ``"32+"``) so the controller can be wired to the real
policy by a thin adapter; the controller does not import the policy package itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

WILDCARD = "*"


@dataclass(frozen=True, slots=True, order=True)
class ContextKey:
    model: str
    workload_class: str
    bucket: str

    def __str__(self) -> str:
        return f"{self.model}/{self.workload_class}/{self.bucket}"


def bucket_labels(lower_edges: Sequence[int]) -> tuple[str, ...]:
    """Labels of the buckets with these inclusive lower edges; the last is open (``"32+"``)."""
    labels = []
    for i, low in enumerate(lower_edges):
        if i == len(lower_edges) - 1:
            labels.append(f"{low}+")
        else:
            high = lower_edges[i + 1] - 1
            labels.append(str(low) if high == low else f"{low}-{high}")
    return tuple(labels)


def bucket_of(concurrency: int | None, lower_edges: Sequence[int]) -> str:
    """The bucket label for a concurrency (unknown or below 1 counts as 1)."""
    index = max(0, bisect.bisect_right(lower_edges, max(1, concurrency or 1)) - 1)
    return bucket_labels(lower_edges)[index]


def bucket_range(label: str, lower_edges: Sequence[int], cap: int) -> tuple[int, int]:
    """Inclusive batch-size range of a bucket, the open one capped at ``cap``."""
    index = bucket_labels(lower_edges).index(label)
    low = lower_edges[index]
    high = lower_edges[index + 1] - 1 if index + 1 < len(lower_edges) else max(cap, low)
    return low, high
