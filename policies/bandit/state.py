"""Versions of the policy's saved state, and the migration that reads older ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATE_VERSION = 4
"""4: push mode's probes back from off (``off_probes``, a commitment's ``until``);
3: exploration keeps per-context credits towards its shares (``credits``) instead of
per-class probe budgets and last-served counts; 2: one entry per part (``learning``,
``planning``, ``exploration``, ``commitment``, ``overrides``); 1: every field at the
top level."""


def migrate(state: Mapping[str, Any]) -> dict[str, Any]:
    """A saved state in the current version's layout (raises on versions it does not
    know)."""
    version = state.get("version")
    if version == 1:
        state, version = _from_version_1(state), 2
    if version == 2:
        # Probe budgets and last-served counts have no counterpart in the shares a
        # route explores: the credits towards them start afresh.
        dropped = ("last_served", "probe_budget")
        exploration = {k: v for k, v in state["exploration"].items() if k not in dropped}
        state, version = {**state, "exploration": {**exploration, "credits": []}}, 3
    if version == 3:
        return {**state, "version": STATE_VERSION, "off_probes": {"next_at": []}}
    if version == STATE_VERSION:
        return dict(state)
    raise ValueError(f"unsupported policy state version {version!r}")


def _from_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
    """Version 1 in version 2's layout. Version 1 may lack what was added after it
    first shipped: the overheads, probe budgets, knee estimates, knee trials and plan
    concurrency."""
    learning = (
        "acceptance",
        "detectors",
        "cost",
        "in_flight",
        "token_shares",
        "shares_at",
        "bucket_concurrency",
        "observations",
        "change_events",
    )
    return {
        "version": 2,
        "arms": list(state["arms"]),
        "overrides": list(state["overrides"]),
        "learning": {
            **{key: state[key] for key in learning},
            "overheads": state.get("overheads", {}),
        },
        "planning": {
            "plans": [
                [key, {**plan, "concurrency": plan.get("concurrency", 0.0)}]
                for key, plan in state["plans"]
            ],
            "knee_seen": state.get("knee_seen", {}),
        },
        "exploration": {
            "class_requests": state["class_requests"],
            "last_served": state["last_served"],
            "probe_budget": state.get("probe_budget", []),
            "selected": state["selected"],
            "explored": state["explored"],
            "explore_rate": state["explore_rate"],
            "trials": state.get("trials", []),
            "bucket_requests": state.get("bucket_requests", []),
            "next_trial": state.get("next_trial", []),
        },
        "commitment": state["commitments"],
    }
