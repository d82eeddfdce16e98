from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from collectors import cli
from controller import cli as controller_cli
from tests.collectors.pages import EngineState, vllm_page

CONTRACT_KEYS = {
    "acceptance_rate",
    "mean_acceptance_length",
    "per_position_acceptance",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "reset",
}


def specpilot_metrics(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specpilot")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["metrics", *argv])
    code: int = args.func(args)
    return code


def dump(tmp_path: Path, name: str, *engines: EngineState, started: float = 1e9) -> str:
    path = tmp_path / name
    path.write_text(vllm_page(engines, process_start_time=started))
    return str(path)


def test_json_window_between_two_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = dump(tmp_path, "a.prom", EngineState(spec=(10, 40, 20, (10, 6, 4, 0))))
    later = dump(tmp_path, "b.prom", EngineState(spec=(30, 110, 55, (25, 15, 10, 5))))

    assert specpilot_metrics(first, later, "--json") == 0
    result = json.loads(capsys.readouterr().out)

    assert set(result) >= CONTRACT_KEYS
    assert (result["drafts"], result["draft_tokens"], result["accepted_tokens"]) == (20, 70, 35)
    assert result["acceptance_rate"] == pytest.approx(35 / 70)
    assert result["mean_acceptance_length"] == pytest.approx(1 + 35 / 20)
    assert result["per_position_acceptance"] == pytest.approx([15 / 20, 9 / 20, 6 / 20, 5 / 20])
    assert result["reset"] is False
    assert list(result["models"]) == ["tiny-llama"]


def test_one_dump_is_since_process_start_and_a_restart_is_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = dump(tmp_path, "a.prom", EngineState(spec=(300, 1200, 600, (200, 200, 100, 100))))
    restarted = dump(tmp_path, "b.prom", EngineState(spec=(5, 20, 4, (3, 1, 0, 0))), started=2e9)
    assert specpilot_metrics(first, "--json") == 0
    assert json.loads(capsys.readouterr().out)["drafts"] == 300
    assert specpilot_metrics(first, restarted, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reset"] is True and result["drafts"] == 5


def test_several_models_are_reported_under_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = dump(
        tmp_path,
        "a.prom",
        EngineState(model_name="code", spec=(10, 40, 30, (10, 10, 6, 4))),
        EngineState(model_name="chat", spec=(10, 40, 10, (6, 3, 1, 0))),
    )
    assert specpilot_metrics(page, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["code"]["acceptance_rate"] == pytest.approx(30 / 40)
    assert result["models"]["chat"]["acceptance_rate"] == pytest.approx(10 / 40)
    assert set(result["models"]["code"]["engines"]) == {"0"}


def test_speculation_off_prints_nulls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = dump(tmp_path, "a.prom", EngineState(generation_tokens=10))
    assert specpilot_metrics(page, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["speculation"] is False
    assert result["acceptance_rate"] is None and result["per_position_acceptance"] == []


def test_text_output_names_the_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = dump(tmp_path, "a.prom", EngineState(spec=(10, 40, 20, (10, 6, 4, 0))))
    assert specpilot_metrics(page) == 0
    out = capsys.readouterr().out
    assert "acceptance rate        0.500" in out
    assert "mean acceptance length 3.000" in out


@pytest.mark.parametrize(
    "content",
    [
        b"<html><body>Not Found</body></html>\n",
        b'{"detail": "Not Found"}',
        b"\x89PNG\r\n\x1a\n\x00",
    ],
)
def test_non_exposition_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / "not-metrics"
    path.write_bytes(content)
    assert specpilot_metrics(str(path), "--json") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert str(path) in captured.err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert specpilot_metrics(str(tmp_path / "nope.prom")) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_specpilot_main_dispatches_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only this feature's module: the others' commands are not this test's concern.
    monkeypatch.setattr(controller_cli, "COMMAND_MODULES", ("collectors.cli",))
    page = dump(tmp_path, "a.prom", EngineState(spec=(10, 40, 20, (10, 6, 4, 0))))
    assert controller_cli.main(["metrics", page, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["acceptance_rate"] == pytest.approx(0.5)
    assert controller_cli.main(["metrics", str(tmp_path)]) == 2
