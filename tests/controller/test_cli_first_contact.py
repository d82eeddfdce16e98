"""What a first-time user meets at the command line: ``--version``, ``config check
--json`` (for scripts), and a closed stdout pipe (``specpilot ... | head -1``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from controller.cli import BROKEN_PIPE_EXIT, main

EXAMPLE = Path(__file__).resolve().parents[2] / "controller" / "examples" / "specpilot.yaml"


def test_version_names_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"specpilot {version('specpilot')}"


def test_config_check_json_when_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "--json", str(EXAMPLE)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and result["errors"] == []
    assert result["file"] == str(EXAMPLE)
    assert "classes: code, chat, rag, creative" in result["summary"]


def test_config_check_json_names_every_error_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "fleet: {pools: {a: {model: m, instances: [http://127.0.0.1:1]}}}\n"
        "buckets: [2, 4]\n"
        "gateway: {default_class: poetry}\n"
    )
    assert main(["config", "check", "--json", str(bad)]) == 2
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["ok"] is False and result["summary"] == []
    assert {e["key"]: e["message"] for e in result["errors"]} == {
        "buckets": "bucket edges must start at 1",
    }
    bad.write_text("fleet: {pools: {a: {model: m, instances: [http://127.0.0.1:1]}}}\n"
                   "gateway: {default_class: poetry}\n")  # fmt: skip
    assert main(["config", "check", "--json", str(bad)]) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert errors == [
        {"key": "gateway.default_class", "message": "'poetry' is not in classes"},
    ]
    # Not a settings file at all: the error is about the file, so no key.
    assert main(["config", "check", "--json", str(tmp_path / "missing.yaml")]) == 2
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["key"] is None and "cannot read" in error["message"]


def run_into_closed_pipe(*args: str, buffered: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``specpilot ARGS`` with stdout a pipe whose reader is already gone; with
    ``buffered`` False every print fails at once (``PYTHONUNBUFFERED``), else at exit."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, whenever it comes
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run(
            [sys.executable, "-m", "controller.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
    finally:
        os.close(write_end)


def test_a_closed_stdout_ends_quietly() -> None:
    # Finished before its output failed (at the flush): the command's own exit code.
    for args in (["config", "check", str(EXAMPLE)], ["--version"], ["--help"]):
        done = run_into_closed_pipe(*args)
        assert (done.stderr, done.returncode) == ("", 0), args
    # Failed while writing: a shell's code for a program SIGPIPE ended; no traceback.
    cut = run_into_closed_pipe("config", "check", str(EXAMPLE), buffered=False)
    assert (cut.stderr, cut.returncode) == ("", BROKEN_PIPE_EXIT)
    # argparse's own exits (help) swallow the error themselves.
    helped = run_into_closed_pipe("metrics", "--help", buffered=False)
    assert (helped.stderr, helped.returncode) == ("", 0)
