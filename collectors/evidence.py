"""A worker's window as the policy's evidence (``WindowObservation``), one per model.

The same figures a request reports per request (``collectors.per_request``), read from
counter increases instead: per-position accepted tokens, drafts, generation tokens, the
step time (``vllm:inter_token_latency_seconds``, observed once per step and request),
the time per output token and the mean batch (``vllm:num_requests_running``). A window
that cannot be evidence says why (``unusable``): the policy must never learn from a
restarted worker's half window or from an idle one.
"""

from __future__ import annotations

from collectors.observations import WindowObservation
from collectors.window import WindowStats, WorkerWindow


def unusable(stats: WindowStats) -> str | None:
    """Why this window is no evidence (one line), or None when it is."""
    if stats.reset:
        return "worker restarted inside the window (counter reset): window skipped"
    if not stats.duration_s or stats.duration_s <= 0:
        return "window has no duration yet (first scrape)"
    if not stats.generation_tokens or stats.generation_tokens <= 0:
        return "no tokens generated in the window (idle)"
    return None


def window_observation(
    model: str, stats: WindowStats, *, finished_at: float
) -> WindowObservation | None:
    """The evidence in one model's window; None when ``unusable`` says it is none."""
    if unusable(stats) is not None:
        return None
    duration = float(stats.duration_s or 0.0)
    spec = stats.spec
    e2e = stats.e2e_latency
    itl = stats.inter_token_latency
    tpot = stats.time_per_output_token
    return WindowObservation(
        model=model,
        started_at=finished_at - duration,
        finished_at=finished_at,
        duration_s=duration,
        requests=max(e2e.count, 0.0) if e2e is not None else 0.0,
        generation_tokens=float(stats.generation_tokens or 0.0),
        drafts=max(spec.drafts, 0.0) if spec is not None else 0.0,
        draft_tokens=max(spec.draft_tokens, 0.0) if spec is not None else 0.0,
        accepted_per_position=_prefix_counts(spec.accepted_per_position, spec.drafts)
        if spec is not None
        else (),
        step_s=itl.mean_s if itl is not None else None,
        tpot_s=tpot.mean_s if tpot is not None else None,
        running=stats.running.mean,
    )


def worker_observations(window: WorkerWindow, *, finished_at: float) -> list[WindowObservation]:
    """One observation per model the worker served in the window (none when unusable)."""
    observations = []
    for name, model in sorted(window.models.items()):
        observation = window_observation(name, model.total, finished_at=finished_at)
        if observation is not None:
            observations.append(observation)
    return observations


def _prefix_counts(per_position: tuple[float, ...], drafts: float) -> tuple[float, ...]:
    """Per-position counts as a prefix (each at most the one before, the first at most
    ``drafts``): a scrape is not atomic, so two snapshots taken mid-update can disagree
    by a verify step, which the acceptance posterior must not see as a contradiction."""
    clamped: list[float] = []
    ceiling = max(drafts, 0.0)
    for accepted in per_position:
        ceiling = min(max(accepted, 0.0), ceiling)
        clamped.append(ceiling)
    return tuple(clamped)
