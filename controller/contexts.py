"""Contexts in the controller: the policy's ``Context`` and its concurrency buckets.

One home for the concept: ``policies.arms`` defines ``Context`` (model × workload class ×
concurrency bucket) and ``ConcurrencyBuckets``; this module only adds what the service
needs on top (wildcards in operator scopes, a bucket's batch-size range for vLLM's
``num_speculative_tokens_per_batch_size``).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.arms import ConcurrencyBuckets, Context
from policies.bandit import WILDCARD

__all__ = [
    "WILDCARD",
    "Context",
    "bucket_labels",
    "bucket_of",
    "bucket_order",
    "bucket_range",
    "context_order",
]


def bucket_labels(lower_edges: Sequence[int]) -> tuple[str, ...]:
    """Labels of the buckets with these inclusive lower edges; the last is open (``"32+"``)."""
    return ConcurrencyBuckets(tuple(lower_edges)).labels


def bucket_of(concurrency: int | None, lower_edges: Sequence[int]) -> str:
    """The bucket label for a concurrency (unknown or below 1 counts as 1)."""
    return ConcurrencyBuckets(tuple(lower_edges)).bucket(concurrency or 1)


def bucket_range(label: str, lower_edges: Sequence[int], cap: int) -> tuple[int, int]:
    """Inclusive batch-size range of a bucket, the open one capped at ``cap``."""
    buckets = ConcurrencyBuckets(tuple(lower_edges))
    low = lower_edges[buckets.labels.index(label)]
    high = buckets.upper(label)
    return low, high if high is not None else max(cap, low)


def bucket_order(label: str) -> tuple[int, str]:
    """Sort key that orders bucket labels by concurrency (``1, 2-3, …, 16-31, 32+``),
    not as strings (``1, 16-31, 2-3, 32+``). A label that is not a bucket's goes last."""
    low = label.split("-", 1)[0].removesuffix("+")
    return (int(low), label) if low.isdigit() else (1 << 62, label)


def context_order(context: Context) -> tuple[str, str, tuple[int, str]]:
    """Sort key for contexts: model, class, then bucket by concurrency."""
    return (context.model, context.workload_class, bucket_order(context.bucket))
