"""How a batch of sequences with mixed arms turns into step time and goodput.

One home for the cost model shared by the simulator (as its physics), the oracle (with
the true parameters) and specpilot's bandit (with learned ones).

A decode step verifies ``γ + 1`` positions for every speculating sequence and one for
every plain one. It costs ``step_s`` while decode is memory-bound and grows linearly
once the batch verifies more than ``knee_tokens`` positions (compute-bound):
``step_s × max(1, T / knee_tokens)``. Each proposer in use adds its drafting: one
draft forward per draft position, ``draft_cost × step_s`` each, for as many positions
as the deepest γ among its sequences (drafts are small, so they stay memory-bound).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from policies.arms import OFF, Arm


@dataclass(frozen=True, slots=True)
class CostParams:
    """Step-time model of one engine. Times in seconds, costs relative to ``step_s``."""

    step_s: float
    """A plain decode step while memory-bound (batch 1)."""
    knee_tokens: float
    """Verified positions per step beyond which a step becomes compute-bound."""
    draft_cost: Mapping[str, float]
    """Per proposer: one draft position's time as a fraction of ``step_s``."""

    def step_time(self, verify_tokens: float, draft_depth: Mapping[str, int]) -> float:
        """Seconds for one step verifying ``verify_tokens`` positions in all.

        ``draft_depth`` maps each proposer in use to the largest γ among its sequences.
        """
        verify = self.step_s * max(1.0, verify_tokens / self.knee_tokens)
        drafting = sum(
            self.draft_cost.get(p, 0.0) * self.step_s * depth for p, depth in draft_depth.items()
        )
        return verify + drafting

    def batch_step_time(self, arms: Iterable[Arm]) -> float:
        """Step time of a batch given every sequence's arm."""
        verify = 0
        depth: dict[str, int] = {}
        for arm in arms:
            verify += arm.verify_tokens
            if arm.proposer is not None:
                depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
        return self.step_time(verify, depth)


Topology = Literal["shared", "per_arm"]
"""How a model's arms map to engines: ``shared`` — one engine batches every arm (one
vLLM serving all traffic; the simulator's fast mode); ``per_arm`` — each arm runs in
its own engine (routing mode: a pool of instances per speculative config)."""

TokensPerStep = Callable[[str, Arm], float]
"""Expected tokens one step emits for a class under an arm (1 for off)."""

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CostDraws:
    """Several plausible :class:`CostParams` at once (posterior draws), as arrays."""

    step_s: FloatArray
    knee_tokens: FloatArray
    draft_cost: Mapping[str, FloatArray]

    @classmethod
    def stack(cls, draws: Sequence[CostParams]) -> CostDraws:
        proposers = sorted({p for d in draws for p in d.draft_cost})
        return cls(
            np.array([d.step_s for d in draws]),
            np.array([d.knee_tokens for d in draws]),
            {p: np.array([d.draft_cost.get(p, 0.0) for d in draws]) for p in proposers},
        )

    def step_time(self, verify_tokens: float, draft_depth: Mapping[str, int]) -> FloatArray:
        verify: FloatArray = self.step_s * np.maximum(1.0, verify_tokens / self.knee_tokens)
        for proposer, depth in draft_depth.items():
            if proposer in self.draft_cost:
                verify = verify + self.draft_cost[proposer] * self.step_s * depth
        return verify


def engine_of(arm: Arm, topology: Topology) -> str:
    """The engine (batch) a sequence on ``arm`` joins: one for all, or one per arm."""
    return str(arm) if topology == "per_arm" else ""


# Up to this many per-class arm combinations, per-arm planning scores them all.
_EXHAUSTIVE_LIMIT = 4096

# Bisection rounds for the stream split between engines (see split_streams): 2**-64
# of the bracket, far below anything the model can tell apart.
_SPLIT_ROUNDS = 64


def split_streams(
    concurrency: float,
    slots: FloatArray,
    verify: FloatArray,
    drafting: FloatArray,
    step_s: FloatArray,
    knee_tokens: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """(streams per unit of slot-time λ, step time per engine) of a closed loop of
    ``concurrency`` streams spread over several engines.

    Arrays are (..., engines): ``slots`` W_e = Σ share / E over the engine's classes,
    ``verify`` V_e = Σ share / E × (γ + 1), ``drafting`` each engine's drafting seconds
    per step; ``step_s`` and ``knee_tokens`` broadcast as (..., 1). An engine holding n
    streams steps in s × max(1, n V/W / knee) + d. Streams sit in an engine in
    proportion to the time their requests take there: n_e = λ W_e step_e(n_e), one λ
    for all engines, and goodput is λ × Σ share. n_e(λ) is closed-form and increasing
    (linear while memory-bound, hyperbolic past the knee, unbounded once λ W_e s V_e/W_e
    reaches the knee), so Σ n_e = concurrency is solved for λ by bisection.
    """
    per_stream = verify / np.maximum(slots, 1e-300)
    # A drafting-free engine past its knee holds any number of streams at one λ; a
    # vanishing drafting time keeps n_e(λ) continuous so bisection can place them.
    drafting = np.maximum(drafting, 1e-9 * step_s)
    growth = slots * step_s * per_stream / knee_tokens
    with np.errstate(divide="ignore"):
        ceiling = np.min(np.where(slots > 0, 1.0 / growth, np.inf), axis=-1)

    def streams(lam: FloatArray) -> FloatArray:
        lam = lam[..., None]
        flat = lam * slots * (step_s + drafting)
        room = 1.0 - lam * growth
        with np.errstate(divide="ignore", invalid="ignore"):
            past_knee = np.where(room > 0, lam * slots * drafting / room, np.inf)
        result: FloatArray = np.where(flat * per_stream <= knee_tokens, flat, past_knee)
        return result

    low = np.zeros_like(ceiling)
    high = ceiling.copy()
    for _ in range(_SPLIT_ROUNDS):
        middle = 0.5 * (low + high)
        too_many = streams(middle).sum(axis=-1) >= concurrency
        high = np.where(too_many, middle, high)
        low = np.where(too_many, low, middle)
    lam = 0.5 * (low + high)
    held = streams(lam)
    held = np.where(np.isfinite(held), held, 0.0)
    steps: FloatArray = step_s * np.maximum(1.0, held * per_stream / knee_tokens) + drafting
    return lam, steps


def steady_state_draws(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens: Mapping[tuple[str, Arm], FloatArray],
    assignment: Mapping[str, Arm],
    cost: CostDraws,
    topology: Topology = "shared",
) -> tuple[FloatArray, dict[str, FloatArray]]:
    """(tokens per second, seconds per step of each class's engine) per draw, for a
    closed loop of ``concurrency`` streams.

    ``tokens[(class, arm)]`` holds each draw's expected tokens per step (off is 1).
    ``token_shares`` is each class's share of the generated tokens it asks for (its
    request share × its mean output length). In steady state a class occupies batch
    slots in proportion to the steps its tokens need (Little's law), i.e. share / E;
    all slots of an engine then advance one step per step time.

    With ``topology="per_arm"`` every arm runs in its own engine (routing mode: a pool
    per speculative config): the streams split between engines in proportion to the
    time their requests spend there, and each engine's step depends only on its own
    streams (see :func:`split_streams`).
    """
    size = len(cost.step_s)
    engines: dict[str, list[str]] = {}
    for cls, share in token_shares.items():
        if share > 0:
            engines.setdefault(engine_of(assignment.get(cls, OFF), topology), []).append(cls)
    if not engines or concurrency <= 0:
        idle = cost.step_time(0.0, {})
        return np.zeros(size), {cls: idle for cls in token_shares}
    total_share = sum(token_shares[cls] for members in engines.values() for cls in members)
    slots = np.zeros((size, len(engines)))
    verify = np.zeros((size, len(engines)))
    drafting = np.zeros((size, len(engines)))
    for index, members in enumerate(engines.values()):
        depth: dict[str, int] = {}
        for cls in members:
            arm = assignment.get(cls, OFF)
            weight = token_shares[cls] / (tokens[(cls, arm)] if arm.proposer is not None else 1.0)
            slots[:, index] += weight
            verify[:, index] += weight * arm.verify_tokens
            if arm.proposer is not None:
                depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
        drafting[:, index] = cost.step_time(0.0, depth) - cost.step_s
    step_s, knee = cost.step_s[:, None], cost.knee_tokens[:, None]
    if len(engines) == 1:
        # One batch holds every stream: nothing to split.
        steps = step_s * np.maximum(1.0, concurrency * verify / slots / knee) + drafting
        rate = concurrency / (slots[:, 0] * steps[:, 0])
    else:
        rate, steps = split_streams(concurrency, slots, verify, drafting, step_s, knee)
    step_of = {
        cls: steps[:, index] for index, members in enumerate(engines.values()) for cls in members
    }
    return rate * total_share, step_of


def steady_state(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
    topology: Topology = "shared",
) -> tuple[float, dict[str, float]]:
    """(tokens per second, seconds per step of each class) for one set of figures.

    See :func:`steady_state_draws`; this is the single-draw form.
    """
    tokens = {
        (cls, arm): np.array([tokens_per_step(cls, arm)])
        for cls, arm in ((c, assignment.get(c, OFF)) for c in token_shares)
        if arm.proposer is not None
    }
    goodput, steps = steady_state_draws(
        concurrency, token_shares, tokens, assignment, CostDraws.stack([cost]), topology
    )
    return float(goodput[0]), {cls: float(step[0]) for cls, step in steps.items()}


def steady_goodput(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
    topology: Topology = "shared",
) -> float:
    """Generated tokens per second in steady state (see :func:`steady_state_draws`)."""
    return steady_state(concurrency, token_shares, tokens_per_step, assignment, cost, topology)[0]


def best_assignment(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    arms: Sequence[Arm],
    cost: CostParams,
    start: Mapping[str, Arm] | None = None,
    max_rounds: int = 4,
    topology: Topology = "shared",
) -> dict[str, Arm]:
    """The per-class arms that maximise :func:`steady_goodput`.

    Classes share a batch, so one class's arm changes what the others pay: a proposer
    whose drafting two classes share can look indispensable to each of them alone.
    Coordinate ascent (each round re-picks every class's best arm given the rest until
    nothing changes) therefore runs from the current decisions, which keeps the answer
    stable when several are equally good, and from everything off; the better end
    point wins. The objective is evaluated incrementally (this runs inside every
    re-plan): with the other classes fixed, slots W, verified positions V and drafting
    depths are sums and maxima that one class's arm only adds to. With one engine per
    arm, classes interact through the split of streams between engines instead, and
    every candidate arm of a class is scored in one vectorised :func:`split_streams`.
    """
    classes = sorted(c for c, s in token_shares.items() if s > 0)
    if not classes or concurrency <= 0:
        return {c: (start or {}).get(c, OFF) for c in classes}
    expected = {(c, a): tokens_per_step(c, a) for c in classes for a in arms}
    for cls, arm in (start or {}).items():
        if cls in token_shares:
            expected[(cls, arm)] = tokens_per_step(cls, arm)
    total_share = sum(token_shares[c] for c in classes)
    step_s, knee = cost.step_s, cost.knee_tokens

    # Every arm a class may hold: the choices, what the classes hold now, and off.
    candidates = list(dict.fromkeys([*arms, *(start or {}).values(), OFF]))
    position = {arm: index for index, arm in enumerate(candidates)}
    one_hot = np.eye(len(candidates))
    draft_s = np.array(
        [cost.draft_cost.get(a.proposer, 0.0) * step_s * a.gamma if a.proposer else 0.0
         for a in candidates]
    )  # fmt: skip
    verify_tokens = np.array([a.verify_tokens for a in candidates], dtype=float)

    def per_arm_scores(current: Mapping[str, Arm], cls: str) -> dict[Arm, float]:
        """Goodput with each candidate arm for ``cls``, the other classes fixed."""
        base = np.zeros(len(candidates))
        for other in classes:
            if other != cls:
                base[position[current[other]]] += (
                    token_shares[other] / expected[(other, current[other])]
                )
        weights = np.array([token_shares[cls] / expected[(cls, a)] for a in candidates])
        slots = base[None, :] + one_hot * weights[:, None]
        verify = slots * verify_tokens[None, :]
        drafting = np.where(slots > 0, draft_s[None, :], 0.0)
        rate, _ = split_streams(
            concurrency, slots, verify, drafting, np.array([[step_s]]), np.array([[knee]])
        )
        return dict(zip(candidates, (rate * total_share).tolist(), strict=True))

    def value(slots: float, verify: float, drafting: float) -> float:
        step = step_s * max(1.0, concurrency * verify / slots / knee) + drafting
        return concurrency * total_share / slots / step

    def ascend(current: dict[str, Arm]) -> dict[str, Arm]:
        for _ in range(max_rounds):
            changed = False
            for cls in classes:
                slots = verify = 0.0
                depth: dict[str, int] = {}
                for other in classes:
                    if other == cls:
                        continue
                    arm = current[other]
                    weight = token_shares[other] / expected[(other, arm)]
                    slots += weight
                    verify += weight * arm.verify_tokens
                    if arm.proposer is not None:
                        depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
                drafting = sum(cost.draft_cost.get(p, 0.0) * step_s * d for p, d in depth.items())
                share = token_shares[cls]

                def score(arm: Arm) -> float:
                    weight = share / expected[(cls, arm)]  # noqa: B023 - used at once
                    extra = 0.0
                    if arm.proposer is not None:
                        deeper = arm.gamma - depth.get(arm.proposer, 0)  # noqa: B023
                        if deeper > 0:
                            extra = cost.draft_cost.get(arm.proposer, 0.0) * step_s * deeper
                    return value(
                        slots + weight,  # noqa: B023
                        verify + weight * arm.verify_tokens,  # noqa: B023
                        drafting + extra,  # noqa: B023
                    )

                scores = (
                    per_arm_scores(current, cls)
                    if topology == "per_arm"
                    else {arm: score(arm) for arm in {*arms, current[cls]}}
                )
                best_arm = current[cls]
                best_value = scores[best_arm]
                for arm in arms:
                    if arm != best_arm and scores[arm] > best_value * (1 + 1e-9):
                        best_arm, best_value = arm, scores[arm]
                if best_arm != current[cls]:
                    current[cls] = best_arm
                    changed = True
            if not changed:
                break
        return current

    def goodput(assignment: Mapping[str, Arm]) -> float:
        return steady_goodput(
            concurrency, token_shares, tokens_per_step, assignment, cost, topology
        )

    if topology == "per_arm" and len(arms) ** len(classes) <= _EXHAUSTIVE_LIMIT:
        # Pools add capacity, so spreading classes over arms can beat every single
        # move from a given point: coordinate ascent stalls there. Few combinations
        # are all scored at once instead.
        choices = np.array(list(itertools.product(range(len(arms)), repeat=len(classes))))
        rows = np.arange(len(choices))
        slots = np.zeros((len(choices), len(candidates)))
        for column, cls in enumerate(classes):
            weights = np.array([token_shares[cls] / expected[(cls, a)] for a in arms])
            engines = np.array([position[a] for a in arms])[choices[:, column]]
            np.add.at(slots, (rows, engines), weights[choices[:, column]])
        rate, _ = split_streams(
            concurrency,
            slots,
            slots * verify_tokens[None, :],
            np.where(slots > 0, draft_s[None, :], 0.0),
            np.array([[step_s]]),
            np.array([[knee]]),
        )
        best = {cls: arms[i] for cls, i in zip(classes, choices[int(np.argmax(rate))], strict=True)}
        kept = {c: (start or {}).get(c, OFF) for c in classes}
        return kept if goodput(kept) >= goodput(best) * (1 - 1e-9) else best
    best = ascend({c: (start or {}).get(c, OFF) for c in classes})
    if start:
        other = ascend(dict.fromkeys(classes, OFF))
        if goodput(other) > goodput(best) * (1 + 1e-9):
            best = other
    return best
