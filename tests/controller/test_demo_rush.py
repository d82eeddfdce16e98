"""The demo shows the product's point: `specpilot demo` as a user runs it (a real
process, the real gateway, loop, bandit and store over the simulated fleet), on the
demo scenario with its phases shortened (quiet, rush, quiet, as in demo.yaml), and in
the rush a class's context runs off or a shorter γ than the same class runs while the
fleet is quiet, by a decision with a reason made on the rush's evidence; the printed
table shows it with the reason, the predicted speed-up and the knee the policy learned.

Why the rush must do that, from the simulated fleet's own figures (not the policy's):
``test_the_demo_rush_is_past_the_knee`` below."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller.demo import DEMO_SCENARIO
from controller.settings import TOKEN_ENV
from policies.arms import OFF, Arm
from policies.fleet import best_assignment, steady_goodput
from simulator.scenario import load_scenario
from simulator.truth import ScenarioTruth
from tests.controller.conftest import free_port

SPEED = 10.0
"""The demo's own default: scenario seconds per wall second."""
QUIET_S, RUSH_S, AFTER_S = 200.0, 250.0, 100.0
"""Scenario seconds of each phase: the demo's 300 / 300 / 300, shortened."""
QUIET_BUCKET = "2-3"
RUSH_BUCKETS = ("16-31", "32+")
LAG_S = 3.0
"""Wall seconds a decision may follow the traffic it rests on (loop interval, batches)."""


def gamma(arm: str) -> int:
    parsed = Arm.parse(arm)
    return 0 if parsed == OFF else parsed.gamma


@dataclass(frozen=True)
class Decision:
    ts: float
    workload_class: str
    bucket: str
    arm: str
    reason: str
    predicted_speedup: float | None


def shortened_scenario(tmp_path: Path) -> Path:
    document = yaml.safe_load(DEMO_SCENARIO.read_text())
    levels = [phase["concurrency"] for phase in document["phases"]]
    starts = [0.0, QUIET_S, QUIET_S + RUSH_S]
    phases = zip(starts, levels, strict=True)
    document["phases"] = [{"at_s": at, "concurrency": n} for at, n in phases]
    document["duration_s"] = QUIET_S + RUSH_S + AFTER_S
    path = tmp_path / "demo-short.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_demo(tmp_path: Path) -> tuple[str, float, list[Decision]]:
    """The demo's output, the wall time its traffic started, and its decisions."""
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "demo", "--data-dir", str(data_dir),
         "--port", str(free_port()), "--speed", str(SPEED),
         "--scenario", str(shortened_scenario(tmp_path))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    started: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            # Printed just before the traffic starts (the table's t counts from there).
            if line.startswith("  gateway ") and not started:
                started.append(time.time())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    process.wait(timeout=300)
    reader.join(10)
    output = "".join(lines)
    assert process.returncode == 0, output
    assert started, output
    with sqlite3.connect(data_dir / "specpilot.db") as db:
        rows = db.execute(
            "SELECT ts, workload_class, bucket, arm, reason, predicted_speedup "
            "FROM decisions ORDER BY id"
        ).fetchall()
    return output, started[0], [Decision(*row) for row in rows]


def arms_at(decisions: list[Decision], at: float) -> dict[tuple[str, str], Decision]:
    """Each context's latest decision made by ``at``."""
    state: dict[tuple[str, str], Decision] = {}
    for decision in decisions:
        if decision.ts <= at:
            state[(decision.workload_class, decision.bucket)] = decision
    return state


def test_in_the_rush_speculation_turns_off_or_shorter_with_its_reason(tmp_path: Path) -> None:
    output, started, decisions = run_demo(tmp_path)
    rush_from = started + QUIET_S / SPEED
    rush_to = started + (QUIET_S + RUSH_S) / SPEED + LAG_S
    # Where, at some moment of the rush, a class's rush context runs a shorter γ (or
    # off) than its quiet context, by a decision taken in the rush.
    shortened: set[tuple[str, str]] = set()
    moments = [d.ts for d in decisions if rush_from <= d.ts <= rush_to] + [rush_to]
    for at in moments:
        state = arms_at(decisions, at)
        for (cls, bucket), rush in state.items():
            quiet = state.get((cls, QUIET_BUCKET))
            if bucket not in RUSH_BUCKETS or quiet is None or rush.ts < rush_from:
                continue
            if gamma(quiet.arm) > 0 and gamma(rush.arm) < gamma(quiet.arm):
                assert rush.reason, rush
                shortened.add((cls, bucket))
    summary = [(round(d.ts - started, 1), d.workload_class, d.bucket, d.arm, d.reason)
               for d in decisions]  # fmt: skip
    assert shortened, summary
    # After the rush the class speculates again where it is quiet, deeper than the rush
    # context, which keeps its arm with the decision's reason.
    final = arms_at(decisions, float("inf"))
    back = {
        (cls, bucket)
        for cls, bucket in shortened
        if gamma(final[(cls, QUIET_BUCKET)].arm) > gamma(final[(cls, bucket)].arm)
    }
    assert back, (shortened, summary)

    # The live table: the knee the policy learned, and a row per context with its arm,
    # reason and predicted speed-up, the rush rows beside the quiet ones.
    tables = output.split("specpilot demo  t=")[1:]
    last = tables[-1]
    assert "phase 2" in last.splitlines()[0], last
    rows = {
        (m["cls"], m["bucket"]): m
        for m in re.finditer(
            r"^(?P<cls>\S+)\s+(?P<bucket>\S+)\s+(?P<arm>\S+)\s+(?P<reason>\S+)\s+(?P<speedup>[\d.]+)$",
            last,
            re.MULTILINE,
        )
    }
    for cls, bucket in back:
        assert (cls, bucket) in rows and (cls, QUIET_BUCKET) in rows, last
        assert rows[(cls, bucket)]["arm"] == final[(cls, bucket)].arm, last
        assert gamma(rows[(cls, QUIET_BUCKET)]["arm"]) > gamma(rows[(cls, bucket)]["arm"]), last
    assert re.search(r"^learned: a pool's step slows past \d+ verified tokens", last, re.M), last


def test_the_demo_rush_is_past_the_knee() -> None:
    """The simulated fleet's own figures (its cost model and acceptance, per pool as
    routing mode runs them) say what the rush should do: quiet, every class gains most
    on EAGLE-3 γ=4; in the rush, keeping them all there costs over half the fleet's
    goodput, and the best moves some class to a shorter γ or off."""
    scenario = load_scenario(DEMO_SCENARIO)
    levels = [phase.concurrency for phase in scenario.phases]
    truth = ScenarioTruth(scenario, lambda: 0.0)()
    arms = [OFF, Arm("eagle3", 4), Arm("ngram", 2)]  # the demo's pools
    shares, tokens = truth.token_shares, truth.tokens_per_step
    eagle = {cls: Arm("eagle3", 4) for cls in shares}
    quiet = best_assignment(levels[0], shares, tokens, arms, scenario.cost, topology="per_arm")
    assert quiet == eagle
    rush = best_assignment(levels[1], shares, tokens, arms, scenario.cost, topology="per_arm")
    assert any(rush[cls].verify_tokens < eagle[cls].verify_tokens for cls in shares), rush
    best = steady_goodput(levels[1], shares, tokens, rush, scenario.cost, "per_arm")
    kept = steady_goodput(levels[1], shares, tokens, eagle, scenario.cost, "per_arm")
    assert kept < 0.5 * best
