"""``specpilot simulate serve|load`` end to end on loopback."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator import cli

SCENARIO = """
seed: 3
duration_s: 600
model: {name: cli-model, step_ms: 20}
proposers:
  ngram: {draft_cost: 0.005, gammas: [2, 3, 4]}
classes:
  code: {share: 1.0, output_tokens: 16, acceptance: {ngram: 0.8}}
phases:
  - {at_s: 0, concurrency: 2}
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specpilot")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture()
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(SCENARIO)
    return path


def test_serve_prints_one_url_per_instance_and_load_runs_against_one(
    scenario_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = [sys.executable, "-c", "import sys; from tests.simulator.test_server_cli import run;"
               " sys.exit(run(sys.argv[1:]))"]  # fmt: skip
    serve = subprocess.Popen(
        [*command, "simulate", "serve", "--scenario", str(scenario_file), "--speed", "20",
         "--pools", "a=off b=ngram:3*2", "--seconds", "30", "--json"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert serve.stdout is not None
        fleet = json.loads(serve.stdout.readline())
        pools = [(i["pool"], i["config"]) for i in fleet["instances"]]
        assert pools == [("a", "off"), ("b", "ngram:3"), ("b", "ngram:3")]
        code = run(["simulate", "load", "--scenario", str(scenario_file), "--speed", "20",
                    "--url", fleet["instances"][1]["url"], "--max-requests", "5"])  # fmt: skip
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 5 and summary["stopped_by"] == "max_requests"
    assert summary["by_class"] == {"code": 5}


def test_bad_pools_are_reported_not_raised(
    scenario_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        run(["simulate", "serve", "--scenario", str(scenario_file), "--pools", "x=eagle3:4"]) == 2
    )
    assert "eagle3" in capsys.readouterr().err
