"""``specpilot bench policy``: specpilot's policy against every baseline, side by side.

Every policy serves the same seeded closed-loop traffic of one scenario on the same
simulated engine (see :mod:`simulator`): off, each static arm, a vLLM-style batch-size
table, ε-greedy, UCB1, specpilot, the fluid oracle (the fluid model's best assignment at
each phase's nominal concurrency, with the true figures) and the oracle, the upper bound
(:class:`simulator.oracle.BatchOracle`: the exactly best assignment for the batch each
request runs in, per drift epoch). The best static arm in hindsight is picked from the
static runs. Goodput is generated tokens per simulated second.

Besides goodput ratios the report holds drift detection (split by whether the drifting
proposer served its class when the drift began), and the latency of specpilot's
``select`` on the request path (``time.perf_counter_ns`` around every call), and per phase
the goodput and the arms each class got from specpilot, the oracle and the best static
config, with what specpilot believed at the end (``learned``: acceptance per class ×
proposer, step-cost fit), so a shortfall can be traced to a belief.

``--bound-check`` runs every shipped scenario and twenty random ones and reports, per
scenario, specpilot's ratio to the oracle and the best any other policy reached: the
oracle is an upper bound only if no policy beats it (beyond the simulator's path noise,
:data:`PATH_NOISE`). ``--seeds`` runs specpilot with more policy seeds on the same
traffic: one scenario's ratio moves by about 1 % with the seed, which a policy change
must be judged apart from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from collectors.observations import RequestObservation
from policies.arms import Arm, ConcurrencyBuckets, Context
from policies.bandit import DRAFT_COST_PRIOR, BanditConfig, SpecPilotPolicy
from policies.base import Clock, Policy
from policies.baselines import UCB1, BatchSizeTable, EpsilonGreedy, OraclePolicy, StaticPolicy
from policies.estimators import ChangeEvent
from simulator.engine import Traffic
from simulator.generate import random_scenario
from simulator.oracle import BatchOracle, oracle_buckets
from simulator.run import Admission, PolicyFactory, RunResult, simulate
from simulator.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from simulator.truth import ScenarioTruth

RESULTS_DIR = Path(__file__).resolve().parent / "results"

TARGETS = {
    "vs_oracle": 0.93,
    "vs_best_static": 1.0,
    "vs_best_static_stationary": 0.99,
    "vs_best_static_where_oracle_gains_20pct": 1.15,
    "vs_off_at_saturation": 0.98,
    "false_alarms": 0,
    "explore_fraction": 0.1,
    "drift_detection_delay_requests": 200,
    "select_p99_us": 50.0,
}

PATH_NOISE = 0.0025
"""How far one run's goodput may sit above the oracle's without the oracle being wrong.

Two policies that decide alike almost everywhere still follow different sample paths
(which requests share a batch, where each stream is when the load changes), and that
alone moves goodput: serving one single request of the oracle's run with ``off``
instead raised the run's goodput by up to 0.22 % (random seed 8 at 600 s) and lowered
it by up to 1.5 % over the bound check's scenarios. A policy ahead of the oracle by
more than this is evidence against the oracle; less is within what chance does."""


@dataclass(frozen=True, slots=True)
class Entrant:
    name: str
    make: PolicyFactory
    buckets: ConcurrencyBuckets | None = None
    """The contexts it is asked in (default: the standard buckets)."""


def entrants(scenario: Scenario, seed: int = 0) -> list[Entrant]:
    """Every policy the benchmark runs, specpilot first."""
    buckets = ConcurrencyBuckets()
    arms = scenario.arms

    # The scenarios name each proposer by its method, so "ngram" is the model-free one.
    # Every class starts on it in the one shared engine: the first step times are of
    # one arm (see ``DRAFT_COST_PRIOR``).
    cold = "ngram" if "ngram" in scenario.proposers else None
    config = BanditConfig(
        cold_proposer=cold, draft_cost_prior=DRAFT_COST_PRIOR if cold is not None else None
    )

    def specpilot(clock: Clock) -> Policy:
        return SpecPilotPolicy(arms, clock=clock, rng=np.random.default_rng(seed), config=config)

    def oracle(clock: Clock) -> Policy:
        return BatchOracle(scenario, clock)

    def fluid_oracle(clock: Clock) -> Policy:
        return OraclePolicy(arms, ScenarioTruth(scenario, clock), "fluid_oracle")

    def static(arm: Arm) -> PolicyFactory:
        return lambda clock: StaticPolicy(arm, "off" if arm.is_off else f"static:{arm}")

    # The operator's table uses the proposer with the best mean acceptance over classes.
    def mean_acceptance(proposer: str) -> float:
        return sum(
            spec.share * spec.acceptance.get(proposer, 0.0) for spec in scenario.classes.values()
        )

    best_proposer = max(scenario.proposers, key=mean_acceptance)
    table = BatchSizeTable.tapering(
        best_proposer, scenario.proposers[best_proposer].gammas, buckets.labels
    )
    out = [
        Entrant("specpilot", specpilot),
        Entrant("oracle", oracle, oracle_buckets(scenario)),
        Entrant("fluid_oracle", fluid_oracle),
        Entrant("batch_size_table", lambda clock: table),
        Entrant(
            "epsilon_greedy",
            lambda clock: EpsilonGreedy(arms, buckets.bucket, np.random.default_rng(seed)),
        ),
        Entrant("ucb1", lambda clock: UCB1(arms, buckets.bucket)),
    ]
    out += [Entrant("off" if a.is_off else f"static:{a}", static(a)) for a in arms]
    return out


@dataclass(frozen=True, slots=True)
class DriftReport:
    delays: list[int | None]
    """Per drift of a proposer serving its class when the drift began: requests of the
    class until the detector fired for that class × proposer (None: never)."""
    idle: list[dict[str, Any]]
    """Drifts of a proposer that did not serve its class then (only probes see them)."""
    false_alarms: int
    """Firings no drift event explains."""


def serving_arm(admissions: Sequence[Admission], workload_class: str, at_s: float) -> Arm | None:
    """The arm a class was served with (not exploring) when a drift began: its last
    such admission at or before ``at_s``; None when it had none."""
    for admission in reversed(admissions):
        if admission.at_s > at_s:
            continue
        if admission.workload_class == workload_class and not admission.explored:
            return admission.arm
    return None


def drift_report(
    scenario: Scenario, result: RunResult, change_events: Sequence[ChangeEvent]
) -> DriftReport:
    """Match every drift event with the first firing for its class × proposer after it."""
    events = sorted(change_events, key=lambda e: e.at_s)
    admissions = sorted(result.admissions, key=lambda a: a.at_s)
    claimed: set[int] = set()
    delays: list[int | None] = []
    idle: list[dict[str, Any]] = []
    for drift in sorted(scenario.drift, key=lambda d: d.at_s):
        match = None
        for i, event in enumerate(events):
            if (
                i not in claimed
                and event.at_s >= drift.at_s
                and event.workload_class == drift.workload_class
                and event.proposer == drift.proposer
            ):
                match = i
                break
        delay = None
        if match is not None:
            claimed.add(match)
            fired = events[match].at_s
            delay = sum(
                1
                for a in admissions
                if a.workload_class == drift.workload_class and drift.at_s <= a.at_s < fired
            )
        served = serving_arm(admissions, drift.workload_class, drift.at_s)
        if served is not None and served.proposer == drift.proposer:
            delays.append(delay)
        else:
            idle.append(
                {
                    "at_s": drift.at_s,
                    "class": drift.workload_class,
                    "proposer": drift.proposer,
                    "acceptance": drift.acceptance,
                    "serving_arm": str(served) if served is not None else None,
                    "detected": delay is not None,
                    "delay_requests": delay,
                }
            )
    return DriftReport(delays, idle, len(events) - len(claimed))


class TimedSelect:
    """A policy whose ``select`` calls are timed (``time.perf_counter_ns``)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.latencies_ns: list[int] = []

    def select(self, context: Context) -> Arm:
        started = time.perf_counter_ns()
        arm = self.policy.select(context)
        self.latencies_ns.append(time.perf_counter_ns() - started)
        return arm

    def best_guess(self, context: Context) -> Arm:
        return self.policy.best_guess(context)

    def observe(self, observation: RequestObservation) -> None:
        self.policy.observe(observation)


@dataclass(slots=True)
class Run:
    """One entrant's run: its result, the drift detector's firings, and (specpilot)
    the latency of every ``select`` call."""

    result: RunResult
    change_events: list[ChangeEvent]
    select_ns: list[int]
    learned: dict[str, Any] | None = None
    """specpilot: what it believed at the end (see :func:`learned_summary`)."""


def _run_group(
    scenario: Scenario, names: list[str], seed: int, traffic: Traffic | None = None
) -> dict[str, Run]:
    """Run some entrants in this process, sharing one traffic draw."""
    traffic = traffic or Traffic(scenario)
    by_name = {e.name: e for e in entrants(scenario, seed)}
    out: dict[str, Run] = {}
    for name in names:
        made: list[Policy] = []
        timed: list[TimedSelect] = []

        def make(
            clock: Clock,
            name: str = name,
            made: list[Policy] = made,
            timed: list[TimedSelect] = timed,
        ) -> Policy:
            policy = by_name[name].make(clock)
            made.append(policy)
            if name == "specpilot":
                timed.append(TimedSelect(policy))
                return timed[0]
            return policy

        result = simulate(scenario, make, buckets=by_name[name].buckets, traffic=traffic)
        events = list(getattr(made[0], "change_events", []))
        learned = learned_summary(made[0]) if isinstance(made[0], SpecPilotPolicy) else None
        out[name] = Run(result, events, timed[0].latencies_ns if timed else [], learned)
    return out


# A worker process's scenario and traffic: drawing the requests is a good part of a
# run's cost, and every entrant a worker runs can share one draw.
_worker: dict[str, Any] = {}


def _init_worker(scenario: Scenario) -> None:
    _worker["scenario"] = scenario
    _worker["traffic"] = Traffic(scenario)


def _run_in_worker(name: str, seed: int) -> dict[str, Run]:
    return _run_group(_worker["scenario"], [name], seed, _worker["traffic"])


def learned_summary(policy: SpecPilotPolicy) -> dict[str, Any]:
    """What specpilot believed at the end of a run, to set beside the scenario's truth:
    per class × proposer its first-position acceptance and the (discounted) requests that
    rests on, and its step-cost fit (plain step, knee, drafting cost per draft position
    as a share of a plain step). The same figures as ``GET /v1/policy``."""
    estimates = policy.estimates()
    return {
        "acceptance": [
            {
                "workload_class": a["workload_class"],
                "proposer": a["proposer"],
                "first_position_acceptance": a["first_position_acceptance"],
                "requests": a["requests"],
            }
            for a in estimates["acceptance"]
        ],
        "cost": [
            {k: c[k] for k in ("model", "step_s", "knee_tokens", "draft_cost")}
            for c in estimates["cost"]
        ],
    }


def phase_breakdown(scenario: Scenario, results: dict[str, RunResult]) -> list[dict[str, Any]]:
    """Per phase: each given run's goodput and the arms it served each class with
    (requests per arm; exploring ones too): where a run lost against another, and how."""
    out: list[dict[str, Any]] = []
    for index, phase in enumerate(scenario.phases):
        arms: dict[str, dict[str, dict[str, int]]] = {name: {} for name in results}
        for name, result in results.items():
            for admission in result.admissions:
                if scenario.phase_at(admission.at_s) == index:
                    by_arm = arms[name].setdefault(admission.workload_class, {})
                    by_arm[str(admission.arm)] = by_arm.get(str(admission.arm), 0) + 1
        out.append(
            {
                "concurrency": phase.concurrency,
                "goodput": {name: r.phase_goodput(index) for name, r in results.items()},
                "arms": arms,
            }
        )
    return out


def latency_summary(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50 / p99 / p99.9 (and max) of per-call latencies, in microseconds."""
    if not latencies_ns:
        return {"p50": math.nan, "p99": math.nan, "p999": math.nan, "max": math.nan, "calls": 0}
    micro = np.asarray(latencies_ns, dtype=np.float64) / 1000.0
    p50, p99, p999 = np.percentile(micro, [50.0, 99.0, 99.9]).tolist()
    return {"p50": p50, "p99": p99, "p999": p999, "max": float(micro.max()), "calls": len(micro)}


def is_stationary(scenario: Scenario) -> bool:
    """One load level for the whole run and no drift: nothing to adapt to."""
    return len({p.concurrency for p in scenario.phases}) == 1 and not scenario.drift


def run_policy_bench(
    scenario: Scenario,
    *,
    seed: int = 0,
    jobs: int = 2,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Run every entrant on the scenario; the JSON-able result the CLI prints.

    Entrants are spread over ``jobs`` processes (round-robin in the order of
    :func:`entrants`, which puts the expensive ones first).
    """
    started = time.perf_counter()
    names = [e.name for e in entrants(scenario, seed)]
    runs: dict[str, Run] = {}
    if progress is not None:
        progress(0, len(names), "starting")
    if jobs <= 1:
        traffic = Traffic(scenario)
        for index, name in enumerate(names):
            runs.update(_run_group(scenario, [name], seed, traffic))
            if progress is not None:
                progress(index + 1, len(names), name)
    else:
        # One entrant per task so progress moves; each worker draws the traffic once.
        with ProcessPoolExecutor(
            max_workers=jobs, initializer=_init_worker, initargs=(scenario,)
        ) as pool:
            futures = {pool.submit(_run_in_worker, n, seed): n for n in names}
            for index, future in enumerate(as_completed(futures)):
                runs.update(future.result())
                if progress is not None:
                    progress(index + 1, len(names), futures[future])
    results = {name: runs[name].result for name in names}
    statics = {n: r for n, r in results.items() if n == "off" or n.startswith("static:")}
    best_name = max(statics, key=lambda n: statics[n].goodput)
    saturation = max(range(len(scenario.phases)), key=lambda i: scenario.phases[i].concurrency)
    specpilot, oracle, off = results["specpilot"], results["oracle"], results["off"]
    best = results[best_name]
    drift = drift_report(scenario, specpilot, runs["specpilot"].change_events)
    admissions = specpilot.admissions
    others = {n: r.goodput for n, r in results.items() if n != "oracle"}
    top = max(others, key=lambda n: others[n])

    def summary(result: RunResult) -> dict[str, float]:
        return {"goodput": result.goodput, "mean_tpot_s": result.mean_tpot_s}

    policies = {name: summary(r) for name, r in results.items()}
    policies["best_static"] = {**summary(best), "arm": best_name}  # type: ignore[dict-item]
    return {
        "scenario": {
            "duration_s": scenario.duration_s,
            "seed": scenario.seed,
            "phases": len(scenario.phases),
            "drift_events": len(scenario.drift),
            "stationary": is_stationary(scenario),
        },
        "policies": policies,
        "ratios": {
            "vs_best_static": specpilot.goodput / best.goodput,
            "vs_oracle": specpilot.goodput / oracle.goodput,
            "vs_fluid_oracle": specpilot.goodput / results["fluid_oracle"].goodput,
            "vs_off_at_saturation": specpilot.phase_goodput(saturation)
            / off.phase_goodput(saturation),
            "oracle_vs_best_static": oracle.goodput / best.goodput,
            "fluid_oracle_vs_oracle": results["fluid_oracle"].goodput / oracle.goodput,
        },
        "bound": {"top_other": top, "top_other_vs_oracle": others[top] / oracle.goodput},
        "drift_detection_delay_requests": drift.delays,
        "idle_arm_drifts": drift.idle,
        "false_alarms": drift.false_alarms,
        "explore_fraction": (
            sum(a.explored for a in admissions) / len(admissions) if admissions else 0.0
        ),
        "select_latency_us": latency_summary(runs["specpilot"].select_ns),
        "phases": phase_breakdown(
            scenario, {"specpilot": specpilot, "oracle": oracle, "best_static": best}
        ),
        "learned": runs["specpilot"].learned,
        "elapsed_s": time.perf_counter() - started,
    }


def check_targets(report: dict[str, Any]) -> dict[str, bool]:
    """Which of the issue's targets this run meets."""
    ratios = report["ratios"]
    mixed = ratios["oracle_vs_best_static"] >= 1.2
    if report["scenario"].get("stationary"):
        static_target = TARGETS["vs_best_static_stationary"]
    elif mixed:
        static_target = TARGETS["vs_best_static_where_oracle_gains_20pct"]
    else:
        static_target = TARGETS["vs_best_static"]
    delays = report["drift_detection_delay_requests"]
    limit = TARGETS["drift_detection_delay_requests"]
    return {
        "vs_oracle": ratios["vs_oracle"] >= TARGETS["vs_oracle"],
        "vs_best_static": ratios["vs_best_static"] >= static_target,
        "vs_off_at_saturation": ratios["vs_off_at_saturation"] >= TARGETS["vs_off_at_saturation"],
        "false_alarms": report["false_alarms"] == 0,
        "explore_fraction": report["explore_fraction"] <= TARGETS["explore_fraction"],
        "drift_detection": all(d is not None and d <= limit for d in delays),
        "select_p99": report["select_latency_us"]["p99"] <= TARGETS["select_p99_us"],
        "oracle_is_bound": report["bound"]["top_other_vs_oracle"] <= 1.0 + PATH_NOISE,
    }


def _bar(index: int, total: int, name: str) -> None:
    width = 30
    filled = width * index // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {index}/{total} {name:<24}")
    if index == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _print_human(report: dict[str, Any]) -> None:
    policies = report["policies"]
    print(f"{'policy':<22} {'goodput tok/s':>14} {'mean TPOT ms':>13}")
    for name, row in sorted(policies.items(), key=lambda kv: -kv[1]["goodput"]):
        label = f"{name} ({row['arm']})" if name == "best_static" else name
        print(f"{label:<22} {row['goodput']:>14.1f} {1000 * row['mean_tpot_s']:>13.2f}")
    print()
    for key, value in report["ratios"].items():
        print(f"{key:<28} {value:.3f}")
    bound = report["bound"]
    print(f"{'best other vs oracle':<28} {bound['top_other_vs_oracle']:.4f} ({bound['top_other']})")
    print(f"{'drift_detection_delay':<28} {report['drift_detection_delay_requests']}")
    for drift in report["idle_arm_drifts"]:
        found = f"after {drift['delay_requests']}" if drift["detected"] else "never"
        print(
            f"{'idle_arm_drift':<28} {drift['class']} × {drift['proposer']} at "
            f"{drift['at_s']:.0f} s (class served by {drift['serving_arm']}): found {found}"
        )
    for index, phase in enumerate(report["phases"]):
        goodput = ", ".join(f"{name} {value:.0f}" for name, value in phase["goodput"].items())
        label = f"phase {index} ({phase['concurrency']} streams)"
        print(f"{label:<28} {goodput} tok/s")
    print(f"{'false_alarms':<28} {report['false_alarms']}")
    print(f"{'explore_fraction':<28} {report['explore_fraction']:.3f}")
    latency = report["select_latency_us"]
    print(
        f"{'select latency µs':<28} p50 {latency['p50']:.1f}, p99 {latency['p99']:.1f}, "
        f"p99.9 {latency['p999']:.1f} ({latency['calls']} calls)"
    )
    checks = check_targets(report)
    print("targets: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items()))
    print(f"(simulated {report['scenario']['duration_s']:.0f} s in {report['elapsed_s']:.1f} s)")


# --- the bound check --------------------------------------------------------------------

SCENARIOS_DIR = Path(__file__).resolve().parent / "scenarios"
BOUND_CHECK_SEEDS = tuple(range(1, 21))
BOUND_CHECK_DURATION_S = 600.0
"""Random scenarios of the bound check are this long: a third of ``--random``'s default,
so the check stays well under two minutes on two cores (same phases and drifts, scaled)."""


def bound_check_scenarios(
    seeds: Sequence[int] = BOUND_CHECK_SEEDS, duration_s: float = BOUND_CHECK_DURATION_S
) -> list[tuple[str, Scenario]]:
    """Every shipped scenario, then one random scenario per seed."""
    out = [(path.stem, load_scenario(path)) for path in sorted(SCENARIOS_DIR.glob("*.yaml"))]
    out += [
        (f"random-{seed}", parse_scenario(random_scenario(seed, duration_s=duration_s)))
        for seed in seeds
    ]
    return out


def _bound_row(
    label: str, scenario: Scenario, seed: int = 0, seeds: Sequence[int] = ()
) -> dict[str, Any]:
    report = run_policy_bench(scenario, seed=seed, jobs=1)
    oracle = report["policies"]["oracle"]["goodput"]
    by_seed = {seed: report["ratios"]["vs_oracle"]}
    if seeds:
        traffic = Traffic(scenario)
        for other in seeds:
            if other not in by_seed:
                run = _run_group(scenario, ["specpilot"], other, traffic)["specpilot"]
                by_seed[other] = run.result.goodput / oracle
    return {
        "scenario": label,
        "vs_oracle": report["ratios"]["vs_oracle"],
        "vs_oracle_by_seed": {str(s): ratio for s, ratio in sorted(by_seed.items())},
        "vs_best_static": report["ratios"]["vs_best_static"],
        "top_other": report["bound"]["top_other"],
        "top_other_vs_oracle": report["bound"]["top_other_vs_oracle"],
        "fluid_oracle_vs_oracle": report["ratios"]["fluid_oracle_vs_oracle"],
        "policies_vs_oracle": {
            name: row["goodput"] / oracle
            for name, row in report["policies"].items()
            if name not in ("oracle", "best_static")
        },
        "stationary": report["scenario"]["stationary"],
        "drift_detection_delay_requests": report["drift_detection_delay_requests"],
        "idle_arm_drifts": report["idle_arm_drifts"],
        "false_alarms": report["false_alarms"],
        "select_latency_us": report["select_latency_us"],
    }


def bound_check(
    scenarios: Sequence[tuple[str, Scenario]],
    jobs: int = 2,
    *,
    seed: int = 0,
    seeds: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """Run the whole bench on every scenario (one process per scenario, ``jobs`` at a
    time); per scenario: specpilot vs the oracle and the best any other policy got.

    ``seeds``: policy seeds specpilot also runs with (alone, on the same traffic), each
    row's ``vs_oracle_by_seed``. One scenario's ratio moves by about ±1 % with the
    policy's seed, so the minimum over scenarios of a single seed judges a policy
    change by noise; the mean and minimum over seeds judge it by the policy."""
    if jobs <= 1:
        return [_bound_row(label, scenario, seed, seeds) for label, scenario in scenarios]

    def work(item: tuple[str, Scenario]) -> float:
        scenario = item[1]
        return scenario.duration_s * max(p.concurrency for p in scenario.phases)

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        # The longest first, so the last ones to finish are short.
        futures = {
            label: pool.submit(_bound_row, label, scenario, seed, seeds)
            for label, scenario in sorted(scenarios, key=work, reverse=True)
        }
        return [futures[label].result() for label, _ in scenarios]


def _print_bound_check(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'scenario':<22} {'vs_oracle':>9} {'vs_best_static':>14} "
        f"{'best other vs oracle':>21}  fluid_oracle  serving drifts / idle"
    )
    for row in rows:
        idle = [d["delay_requests"] if d["detected"] else None for d in row["idle_arm_drifts"]]
        print(
            f"{row['scenario']:<22} {row['vs_oracle']:>9.3f} {row['vs_best_static']:>14.3f} "
            f"{row['top_other_vs_oracle']:>8.4f} {row['top_other']:<12} "
            f"{row['fluid_oracle_vs_oracle']:>12.4f}  {row['drift_detection_delay_requests']} "
            f"/ {idle}"
            + (
                f"  seeds {min(by_seed.values()):.3f}–{max(by_seed.values()):.3f}"
                if len(by_seed := row["vs_oracle_by_seed"]) > 1
                else ""
            )
        )
    worst = max(rows, key=lambda r: r["top_other_vs_oracle"])
    below = [r["scenario"] for r in rows if r["vs_oracle"] < TARGETS["vs_oracle"]]
    print(
        f"best other vs oracle at most {worst['top_other_vs_oracle']:.4f} "
        f"({worst['top_other']} on {worst['scenario']}; bound holds within path noise "
        f"{PATH_NOISE:.2%}: {'yes' if worst['top_other_vs_oracle'] <= 1 + PATH_NOISE else 'NO'})"
    )
    print(
        f"specpilot vs_oracle {min(r['vs_oracle'] for r in rows):.3f}–"
        f"{max(r['vs_oracle'] for r in rows):.3f}; below {TARGETS['vs_oracle']}: "
        + (", ".join(below) if below else "none")
    )
    summary = seeds_summary(rows)
    if len(summary["seeds"]) > 1:
        print(
            f"over policy seeds {', '.join(summary['seeds'])}: mean {summary['mean']:.4f}, "
            f"minimum {summary['min']:.3f} ({summary['min_at']}), per seed "
            + ", ".join(f"{s} {m:.3f}" for s, m in summary["min_by_seed"].items())
        )


def seeds_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """specpilot vs the oracle over every scenario and policy seed of a bound check:
    the mean, the minimum and where, and each seed's minimum over the scenarios."""
    seeds = list(rows[0]["vs_oracle_by_seed"]) if rows else []
    cells = [(r["vs_oracle_by_seed"][s], r["scenario"], s) for r in rows for s in seeds]
    if not cells:
        return {"seeds": [], "mean": math.nan, "min": math.nan, "min_at": "", "min_by_seed": {}}
    low = min(cells)
    return {
        "seeds": seeds,
        "mean": float(np.mean([c[0] for c in cells])),
        "min": low[0],
        "min_at": f"{low[1]}, seed {low[2]}",
        "min_by_seed": {s: min(c[0] for c in cells if c[2] == s) for s in seeds},
    }


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "policy", help="specpilot's policy vs. baselines and an oracle on a simulated scenario"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", type=Path, help="scenario YAML file")
    source.add_argument(
        "--random",
        type=int,
        metavar="SEED",
        help="a random scenario drawn from SEED (simulator.generate), for unseen fleets",
    )
    source.add_argument(
        "--bound-check",
        action="store_true",
        help="every shipped scenario and random seeds 1-20: does any policy beat the oracle?",
    )
    parser.add_argument(
        "--stationary",
        action="store_true",
        help="with --random: one load level for the whole run and no drift",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"simulated seconds of random scenarios (default 1800; "
        f"{BOUND_CHECK_DURATION_S:.0f} for --bound-check)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' RNGs")
    parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=(),
        metavar="S1,S2,...",
        help="with --bound-check: policy seeds specpilot also runs with, alone on the same "
        "traffic (per-scenario ratios move by about 1 %% with the seed)",
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="processes to run the policies in (default 2)"
    )
    parser.set_defaults(func=main)


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        message = f"not a comma-separated list of integers: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def main(args: argparse.Namespace) -> int:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if args.seeds and not args.bound_check:
        print("specpilot bench policy: --seeds goes with --bound-check", file=sys.stderr)
        return 2
    if args.bound_check:
        duration = args.duration or BOUND_CHECK_DURATION_S
        started = time.perf_counter()
        rows = bound_check(
            bound_check_scenarios(duration_s=duration),
            jobs=args.jobs,
            seed=args.seed,
            seeds=args.seeds,
        )
        result = {
            "random_duration_s": duration,
            "path_noise": PATH_NOISE,
            "scenarios": rows,
            "over_seeds": seeds_summary(rows),
            "elapsed_s": time.perf_counter() - started,
        }
        (RESULTS_DIR / "policy-bound-check.json").write_text(
            json.dumps(result, indent=2) + "\n", encoding="utf-8"
        )
        if args.json:
            print(json.dumps(result))
        else:
            _print_bound_check(rows)
            print(f"({result['elapsed_s']:.0f} s)")
        return 0
    try:
        if args.scenario is not None:
            scenario, label = load_scenario(args.scenario), args.scenario.stem
        else:
            data = random_scenario(
                args.random, duration_s=args.duration or 1800.0, stationary=args.stationary
            )
            scenario = parse_scenario(data)
            label = f"random-{args.random}" + ("-stationary" if args.stationary else "")
    except (OSError, ScenarioError) as exc:
        print(f"specpilot bench policy: {exc}", file=sys.stderr)
        return 2
    report = run_policy_bench(
        scenario, seed=args.seed, jobs=args.jobs, progress=None if args.json else _bar
    )
    report["scenario"]["file"] = str(args.scenario) if args.scenario else None
    report["scenario"]["random_seed"] = args.random
    (RESULTS_DIR / f"policy-{label}.json").write_text(
        json.dumps(report, indent=2) + "\n", encoding="utf-8"
    )
    if args.json:
        print(json.dumps(report))
    else:
        _print_human(report)
    return 0
