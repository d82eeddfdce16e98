"""How a batch of sequences with mixed arms turns into step time and goodput.

One home for the cost model shared by the simulator (as its physics), the oracle (with
the true parameters) and specpilot's bandit (with learned ones).

A decode step verifies ``γ + 1`` positions for every speculating sequence and one for
every plain one. It costs ``step_s`` while decode is memory-bound and grows linearly
once the batch verifies more than ``knee_tokens`` positions (compute-bound):
``step_s × max(1, T / knee_tokens)``. Each proposer in use adds its drafting: one
draft forward per draft position, ``draft_cost × step_s`` each, for as many positions
as the deepest γ among its sequences (drafts are small, so they stay memory-bound).

In steady state (:func:`steady_state_draws`) a batch of n streams holds, at each step,
n sequences drawn from the classes in proportion to their slots, so the drafting a step
pays is that of the deepest γ among n draws, not the deepest γ any class uses: with one
stream only the running request's own γ drafts, with many the deepest one does.
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
IntArray = npt.NDArray[np.int64]


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


# Up to this many per-class arm combinations (three classes over the simulator's 17
# arms), the assignment search scores them all.
_EXHAUSTIVE_LIMIT = 5000

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


def expected_depth(above: FloatArray, concurrency: float) -> FloatArray:
    """Expected deepest γ of one proposer among ``concurrency`` sequences drawn
    independently, where ``above[..., g]`` is the share of sequences drafting deeper
    than g with it: Σ_g P(some sequence drafts deeper than g)."""
    streams = max(concurrency, 1.0)
    result: FloatArray = (1.0 - (1.0 - np.clip(above, 0.0, 1.0)) ** streams).sum(axis=-1)
    return result


def _drafting_levels(arms: Sequence[Arm]) -> dict[str, FloatArray]:
    """Per proposer: (arms × γ levels) indicators of an arm drafting deeper than g."""
    tops: dict[str, int] = {}
    for arm in arms:
        if arm.proposer is not None:
            tops[arm.proposer] = max(tops.get(arm.proposer, 0), arm.gamma)
    return {
        proposer: np.array(
            [[arm.proposer == proposer and arm.gamma > g for g in range(top)] for arm in arms],
            dtype=np.float64,
        )
        for proposer, top in tops.items()
    }


def _shared_batch(
    concurrency: float,
    weights: FloatArray,
    verify: FloatArray,
    levels: Mapping[str, FloatArray],
    step_s: FloatArray,
    knee_tokens: FloatArray,
    draft_s: Mapping[str, FloatArray],
) -> tuple[FloatArray, FloatArray]:
    """(streams per unit of slot-time, seconds per step) of one batch of
    ``concurrency`` closed-loop streams, for N cases at once.

    ``weights`` (N, C): each class's slots (share / E); ``verify`` (N, C): its verified
    positions per step; ``levels[p]`` (N, C, G): whether its arm drafts deeper than g
    with proposer p; ``step_s``, ``knee_tokens`` and ``draft_s[p]`` (drafting seconds
    per position) broadcast as (N,). Goodput is the first result × Σ share.
    """
    slots = weights.sum(axis=-1)
    verified = (weights * verify).sum(axis=-1)
    step = step_s * np.maximum(1.0, concurrency * verified / slots / knee_tokens)
    for proposer, level in levels.items():
        above = np.einsum("nc,ncg->ng", weights, level) / slots[:, None]
        step = step + draft_s.get(proposer, 0.0) * expected_depth(above, concurrency)
    rate: FloatArray = concurrency / (slots * step)
    return rate, step


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
    all slots of an engine then advance one step per step time, and each proposer
    drafts as deep as the deepest γ among the sequences of a step (see the module).

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

    def weight(cls: str) -> FloatArray:
        arm = assignment.get(cls, OFF)
        per_draw = tokens[(cls, arm)] if arm.proposer is not None else 1.0
        return np.broadcast_to(token_shares[cls] / np.asarray(per_draw, dtype=np.float64), size)

    if len(engines) == 1:
        # One batch holds every stream: nothing to split.
        (members,) = engines.values()
        held = [assignment.get(cls, OFF) for cls in members]
        levels = _drafting_levels(held)
        rate, step = _shared_batch(
            concurrency,
            np.stack([weight(cls) for cls in members], axis=-1),
            np.array([arm.verify_tokens for arm in held], dtype=np.float64)[None, :],
            {p: level[None, :, :] for p, level in levels.items()},
            cost.step_s,
            cost.knee_tokens,
            {p: cost.draft_cost[p] * cost.step_s for p in levels if p in cost.draft_cost},
        )
        return rate * total_share, dict.fromkeys(members, step)
    slots = np.zeros((size, len(engines)))
    verify = np.zeros((size, len(engines)))
    drafting = np.zeros((size, len(engines)))
    for index, members in enumerate(engines.values()):
        depth: dict[str, int] = {}
        for cls in members:
            arm = assignment.get(cls, OFF)
            slots[:, index] += weight(cls)
            verify[:, index] += weight(cls) * arm.verify_tokens
            if arm.proposer is not None:
                depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
        drafting[:, index] = cost.step_time(0.0, depth) - cost.step_s
    step_s, knee = cost.step_s[:, None], cost.knee_tokens[:, None]
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


def steady_batch(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
    topology: Topology = "shared",
) -> dict[Arm, float]:
    """The other sequences one request finds in flight, per arm, in steady state:
    ``concurrency - 1`` in all, each class's in proportion to the time its requests
    hold a stream (its slots × its engine's step time)."""
    _, step = steady_state(concurrency, token_shares, tokens_per_step, assignment, cost, topology)
    held = {
        cls: token_shares[cls] / tokens_per_step(cls, arm) * step[cls]
        for cls, arm in ((c, assignment.get(c, OFF)) for c, s in token_shares.items() if s > 0)
    }
    total = sum(held.values())
    out: dict[Arm, float] = {}
    if total <= 0:
        return out
    for cls, time in held.items():
        arm = assignment.get(cls, OFF)
        out[arm] = out.get(arm, 0.0) + max(concurrency - 1.0, 0.0) * time / total
    return out


def best_assignment(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    arms: Sequence[Arm],
    cost: CostParams,
    start: Mapping[str, Arm] | None = None,
    max_rounds: int = 6,
    topology: Topology = "shared",
) -> dict[str, Arm]:
    """The per-class arms that maximise :func:`steady_goodput`.

    Where the classes' arm combinations are few (``_EXHAUSTIVE_LIMIT``) all of them are
    scored at once, vectorised. Otherwise the search climbs from several starts: the
    current decisions, everything off, and the best "one arm for all" assignments.
    Each round re-picks every class's arm given the rest, then moves every group of
    classes sharing an arm together: classes share a batch, so a proposer whose
    drafting two classes share (or, in per-arm pools, a pool two classes fill) can
    look indispensable to each of them alone, and single moves stall there. The
    current decisions are kept unless something beats them, so the answer stays
    stable when several are equally good.
    """
    classes = sorted(c for c, s in token_shares.items() if s > 0)
    kept_arms = {c: (start or {}).get(c, OFF) for c in classes}
    if not classes or concurrency <= 0:
        return kept_arms
    # Every arm a class may hold: the choices, what the classes hold now, and off.
    candidates = list(dict.fromkeys([*arms, *kept_arms.values(), OFF]))
    position = {arm: index for index, arm in enumerate(candidates)}
    choices = np.array(sorted({position[a] for a in arms}), dtype=np.int64)
    table = np.array(
        [[tokens_per_step(c, a) if a.proposer is not None else 1.0 for a in candidates]
         for c in classes]
    )  # fmt: skip
    weights = np.array([token_shares[c] for c in classes])[:, None] / table
    total_share = sum(token_shares[c] for c in classes)
    verify_tokens = np.array([a.verify_tokens for a in candidates], dtype=np.float64)
    step_s, knee = np.array([cost.step_s]), np.array([cost.knee_tokens])
    columns = np.arange(len(classes))

    if topology == "per_arm":
        draft_s = np.array(
            [cost.draft_cost.get(a.proposer, 0.0) * cost.step_s * a.gamma if a.proposer else 0.0
             for a in candidates]
        )  # fmt: skip

        def score(rows: IntArray) -> FloatArray:
            slots = np.zeros((len(rows), len(candidates)))
            np.add.at(slots, (np.arange(len(rows))[:, None], rows), weights[columns, rows])
            rate, _ = split_streams(
                concurrency,
                slots,
                slots * verify_tokens[None, :],
                np.where(slots > 0, draft_s[None, :], 0.0),
                step_s[:, None],
                knee[:, None],
            )
            result: FloatArray = rate * total_share
            return result

    else:
        levels = _drafting_levels(candidates)
        draft_per_position = {
            p: np.array([cost.draft_cost.get(p, 0.0) * cost.step_s]) for p in levels
        }

        def score(rows: IntArray) -> FloatArray:
            rate, _ = _shared_batch(
                concurrency,
                weights[columns, rows],
                verify_tokens[rows],
                {p: level[rows] for p, level in levels.items()},
                step_s,
                knee,
                draft_per_position,
            )
            result: FloatArray = rate * total_share
            return result

    kept = np.array([position[kept_arms[c]] for c in classes], dtype=np.int64)
    if len(choices) ** len(classes) <= _EXHAUSTIVE_LIMIT:
        rows = np.array(list(itertools.product(choices.tolist(), repeat=len(classes))))
        values = score(rows)
        best_row, best_value = rows[int(np.argmax(values))], float(values.max())
    else:
        best_row, best_value = climb(score, kept, choices, max_rounds)
        uniform = np.repeat(choices[:, None], len(classes), axis=1)
        off = np.full(len(classes), position[OFF], dtype=np.int64)
        for row in [off, *uniform[np.argsort(-score(uniform))[:3]]]:
            row, value = climb(score, row, choices, max_rounds)
            if value > best_value * (1 + 1e-9):
                best_row, best_value = row, value
    if float(score(kept[None, :])[0]) >= best_value * (1 - 1e-9):
        return kept_arms
    return {c: candidates[int(i)] for c, i in zip(classes, best_row, strict=True)}


def climb(
    score: Callable[[IntArray], FloatArray], row: IntArray, choices: IntArray, rounds: int
) -> tuple[IntArray, float]:
    """Coordinate ascent over per-class arm indices (``row``, each one of ``choices``)
    maximising ``score`` (rows → values), with group and pair moves (see
    :func:`best_assignment`); the end point and its score."""
    row = row.copy()
    value = float(score(row[None, :])[0])
    for _ in range(rounds):
        improved = False
        groups = [[c] for c in range(len(row))]
        groups += [
            members
            for arm in np.unique(row)
            if len(members := np.flatnonzero(row == arm).tolist()) > 1
        ]
        for members in groups:
            moves = np.repeat(row[None, :], len(choices), axis=0)
            moves[:, members] = choices[:, None]
            scores = score(moves)
            best = int(np.argmax(scores))
            if scores[best] > value * (1 + 1e-9):
                row, value, improved = moves[best].copy(), float(scores[best]), True
        if not improved:
            # Two classes at once: one giving up a proposer's depth while another
            # takes it up gains where neither move alone does.
            pairs = list(itertools.combinations(range(len(row)), 2))
            if not pairs:
                break
            first, second = np.meshgrid(choices, choices, indexing="ij")
            moves = np.repeat(row[None, :], len(pairs) * first.size, axis=0)
            for index, (a, b) in enumerate(pairs):
                block = slice(index * first.size, (index + 1) * first.size)
                moves[block, a] = first.ravel()
                moves[block, b] = second.ravel()
            scores = score(moves)
            best = int(np.argmax(scores))
            if scores[best] > value * (1 + 1e-9):
                row, value, improved = moves[best].copy(), float(scores[best]), True
        if not improved:
            break
    return row, value
