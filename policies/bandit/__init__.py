"""specpilot's policy: a structured, discounted Thompson-sampling bandit with guard rails.

What it learns, and where each piece is shared:

* acceptance per model × workload class × proposer (:class:`AcceptanceModel`), shared
  across γ — per-position counts from a run at γ inform every γ' ≤ γ — and across
  concurrency buckets;
* step cost per model (:class:`StepCostModel`): plain step time, compute knee and
  each proposer's drafting cost, from which the cost of every proposer × γ × bucket
  follows; it is fed with the batch composition the policy itself assigned;
* the traffic mix per model (each class's share of generated tokens).

The reward of an arm for a context is the per-token latency speed-up of that class
relative to no speculation at the same concurrency, as the fleet model predicts it;
because classes share a batch, the arms of all classes in a bucket are chosen jointly
(:func:`policies.fleet.best_assignment`). Thompson sampling draws plausible acceptances
from their posteriors and explores the arm that world prefers (at the mean step cost:
see ``_plan``); evidence is discounted with a
half-life so the bandit keeps adapting, and a CUSUM change detector per class ×
proposer resets acceptance that went stale. The step cost's knee can only be seen by
running past it: where every batch so far stayed below it, the cost model puts it at the
edge of what was seen, and knee trials (``_start_trial``) now and then run a bucket one
knee cell bolder, within a bounded worst-case loss, so the estimate can rise.

Guard rails: a class speculates only while the lower confidence bound (a posterior
quantile) of its effect on the bucket's goodput is at least 1; a committed decision
changes only after ``dwell_s`` and when the new arm is predicted better by
``hysteresis`` (pushes can cost restarts), except that safety (turning off) never waits;
exploration is capped to ``explore_cap`` of requests; operator overrides always win.

The API the controller uses:

* ``context(model, workload_class, concurrency) -> Context``: bucket a request;
* ``select(context) -> Arm`` (or ``choose`` for the full :class:`Decision`): per request,
  may explore within the cap. It reads the context's :class:`Route` (the arm and the
  shares of requests that explore), which planning publishes off the request path;
* ``routes() -> {Context: Route}``: every route, plain picklable data, for a process
  that routes by itself;
* ``decide(context) -> Decision``: the committed arm for a context, with the reason and
  the predicted speed-up and its interval (re-plans the bucket if due);
* ``observe(observation)``: learn from a finished request, and re-plan the buckets of
  its model that served requests and are due;
* ``set_override`` / ``clear_override``: operator overrides by scope with ``*`` wildcards;
* ``estimates()``: a JSON-able read-out for ``GET /v1/policy``;
* ``state_dict()`` / ``load_state_dict()``: JSON-able persistence.

The parts, each owning its state (``to_state`` / ``load_state``):

* :mod:`.config`: tuning (:class:`BanditConfig`), decisions, operator overrides;
* :mod:`.learning`: acceptance, drift, step cost, traffic mix, concurrency;
* :mod:`.planning`: per-bucket joint plans and the guard rail;
* :mod:`.exploration`: Thompson exploration within the cap, probes and their
  budgets, knee trials;
* :mod:`.commitment`: committed arms, dwell and hysteresis;
* :mod:`.state`: the saved state's version and the migration of older ones;
* :mod:`.policy`: :class:`SpecPilotPolicy`, which composes them.
"""

from policies.bandit.commitment import _Commitment
from policies.bandit.config import (
    DEFAULT_CLASS,
    DEFAULT_MODEL,
    DRAFT_COST_PRIOR,
    WILDCARD,
    BanditConfig,
    Decision,
    Override,
    Route,
    _quantile,
)
from policies.bandit.exploration import _EXPLORING, _Trial
from policies.bandit.learning import _OVERHEAD_CAP, steps_taken
from policies.bandit.planning import _Plan
from policies.bandit.policy import SpecPilotPolicy
from policies.bandit.state import STATE_VERSION

__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_MODEL",
    "DRAFT_COST_PRIOR",
    "STATE_VERSION",
    "WILDCARD",
    "_EXPLORING",
    "_OVERHEAD_CAP",
    "BanditConfig",
    "Decision",
    "Override",
    "Route",
    "SpecPilotPolicy",
    "_Commitment",
    "_Plan",
    "_Trial",
    "_quantile",
    "steps_taken",
]
