"""Why a context runs what it runs: the one vocabulary of decision reasons.

Every decision the control loop records (``/v1/decisions``, the ``decision`` log line)
and every route a gateway follows carries one of these words; its free text
(``detail``) only adds the figures. README's "Decision reasons" lists them all, and a
test holds the two together.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # -- the policy's, per context -----------------------------------------------------
    LEARNING = "learning"
    """The bucket has no plan yet, or the arms' acceptance is still mostly the prior's:
    the context follows the plan, which is how the evidence matures."""
    BEST = "best"
    """The plan's best arm for the bucket, and it pays by the hysteresis margin (or it
    already ran)."""
    GUARD_OFF = "guard_off"
    """Speculation does not surely pay here: in more than the guard quantile of the
    posterior's worlds it lowers the bucket's goodput. Turning off never waits."""
    INCUMBENT = "incumbent"
    """Push mode: the arm its pool runs stays until the evidence of both that arm (its
    acceptance, and traffic at this concurrency) and the candidate justifies a push."""
    DWELL = "dwell"
    """A better arm exists, but the committed one has run less than the dwell time."""
    HYSTERESIS = "hysteresis"
    """A better arm exists, but it does not gain the hysteresis margin surely enough to
    be worth a move."""
    PROBE = "probe"
    """Push mode: a context on off tries its best proposer's smallest γ for a bounded
    time, at a spacing its predicted cost prices: nothing else would show that
    speculation pays there again. Per request (routing mode): a request sent to a
    proposer its class does not use, to keep that proposer's acceptance fresh."""
    OVERRIDE = "override"
    """An operator pinned the arm (``POST /v1/overrides``)."""
    # -- per request, routing mode -------------------------------------------------------
    EXPLORE = "explore"
    """A request sent to the bucket's Thompson arm, within the exploration cap."""
    TRIAL = "trial"
    """A request of a knee trial: its bucket runs one knee cell bolder for a batch."""
    # -- the control loop's --------------------------------------------------------------
    OVERRIDE_ENDED = "override_ended"
    """The operator's pin ended; the policy chose again (its reason is in the detail)."""
    NO_EVIDENCE = "no_evidence"
    """A pin ended and nothing was observed in the context yet: it returns to the config
    its pool runs."""
    NO_POOL = "no_pool"
    """Routing mode: no pool runs the policy's arm, so the pool without speculation
    serves the context."""
    PLUGIN = "plugin"
    """A plugged-in policy (``wiring.policy``) gave a reason of its own: it is the
    detail."""
    HOLD = "hold"
    """No policy is wired (a replica that only serves): the context keeps what it runs."""
    UNAVAILABLE = "unavailable"
    """The policy prefers an arm no pool here may run: the context keeps what it runs."""


def reason_of(word: str) -> Reason:
    """The reason a policy or a route gave, as a member of the vocabulary."""
    try:
        return Reason(word)
    except ValueError:
        raise ValueError(f"{word!r} is no decision reason (see policies.reasons)") from None
