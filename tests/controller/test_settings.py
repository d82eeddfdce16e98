"""Settings: YAML plus SPECPILOT_* environment, errors that name the key, `config check`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from controller.cli import main
from controller.settings import SettingsError, load_settings

EXAMPLE = Path(__file__).resolve().parents[2] / "controller" / "examples" / "specpilot.yaml"

MINIMAL = """
fleet:
  pools:
    a:
      model: m
      instances: ["http://127.0.0.1:9"]
      proposers:
        ngram: {method: ngram, gamma: [1, 4]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_example_is_valid() -> None:
    settings = load_settings(EXAMPLE, environ={})
    assert set(settings.fleet.pools) == {"llama-code", "llama-chat"}
    assert settings.bucket_labels == ("1", "2-3", "4-7", "8-15", "16-31", "32+")


def test_defaults_and_sqlite_in_data_dir(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, f"data_dir: {tmp_path}\n" + MINIMAL), environ={})
    assert settings.store_url == f"sqlite:///{tmp_path.resolve()}/specpilot.db"
    assert settings.api.token is None
    assert settings.fleet.pools["a"].speculative_config == {"method": "off"}
    assert settings.fleet.pools["a"].instances == ["http://127.0.0.1:9"]  # kept as written


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "scrape_interval_s: 30\n" + MINIMAL)
    monkeypatch.setenv("SPECPILOT_SCRAPE_INTERVAL_S", "5")
    monkeypatch.setenv("SPECPILOT_STORE__URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("SPECPILOT_API_TOKEN", "s3cret")
    monkeypatch.setenv("SPECPILOT_FLEET__POOLS__A__MODEL", "other")
    settings = load_settings(path)
    assert settings.scrape_interval_s == 5
    assert settings.store_url == "postgresql+psycopg://u@h/db"
    assert settings.api.token is not None and settings.api.token.get_secret_value() == "s3cret"
    assert settings.fleet.pools["a"].model == "other"
    assert settings.fleet.pools["a"].proposers["ngram"].gamma == (1, 4)


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d["fleet"]["pools"]["a"].pop("model"), "fleet.pools.a.model: Field required"),
        (lambda d: d["fleet"]["pools"]["a"].update(instances=[]), "fleet.pools.a.instances"),
        (
            lambda d: d["fleet"]["pools"]["a"].update(instances=["ftp://x"]),
            "fleet.pools.a.instances.0: URL scheme should be 'http' or 'https'",
        ),
        (
            lambda d: d["fleet"]["pools"]["a"]["proposers"]["ngram"].update(gamma=[3, 1]),
            "fleet.pools.a.proposers.ngram.gamma: need 1 <= min <= max",
        ),
        (
            lambda d: d["fleet"]["pools"]["a"]["proposers"]["ngram"].update(method="magic"),
            "fleet.pools.a.proposers.ngram.method",
        ),
        (
            lambda d: d["fleet"]["pools"]["a"].update(
                speculative_config={
                    "method": "draft_model",
                    "model": "x",
                    "num_speculative_tokens": 2,
                }
            ),
            "fleet.pools.a.speculative_config: pool 'a' has no 'draft_model' proposer",
        ),
        (
            lambda d: d["fleet"]["pools"]["a"].update(
                speculative_config={"method": "ngram", "num_speculative_tokens": 9}
            ),
            "out of range on pool 'a'",
        ),
        (
            lambda d: d["fleet"]["pools"]["a"]["proposers"]["ngram"].update(
                tuning={"prompt_lookup_min": 5, "prompt_lookup_max": 2}
            ),
            "fleet.pools.a.proposers.ngram: prompt_lookup_min (5)",
        ),
        (lambda d: d.update(buckets=[2, 4]), "buckets: bucket edges must start at 1"),
        (lambda d: d.update(scrape_interval_s=0), "scrape_interval_s: Input should be greater"),
        (lambda d: d.update(colour="blue"), "colour: Extra inputs are not permitted"),
        (
            lambda d: d["fleet"]["pools"]["a"].update(classes=["poetry"]),
            "fleet.pools.a.classes: unknown classes ['poetry']",
        ),
    ],
)
def test_errors_name_the_key(tmp_path: Path, edit: object, key: str) -> None:
    data = yaml.safe_load(MINIMAL)
    edit(data)  # type: ignore[operator]
    with pytest.raises(SettingsError) as error:
        load_settings(write(tmp_path, yaml.safe_dump(data)), environ={})
    assert any(key in line for line in error.value.problems), error.value.problems


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", environ={})
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(write(tmp_path, "fleet: [unclosed"), environ={})
    with pytest.raises(SettingsError, match="top level must be a mapping"):
        load_settings(write(tmp_path, "- a\n- b\n"), environ={})


def test_config_check_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "pool llama-code" in out
    bad = write(tmp_path, "scrape_interval_s: -1\nfleet: {pools: {}}\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("error: fleet.pools:") or err[1].startswith("error: fleet.pools:")
    assert any(line.startswith("error: scrape_interval_s:") for line in err)


def test_config_check_refuses_parameters_the_policy_does_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["policy"]["params"] = {"exploration": 0.1}
    assert main(["config", "check", str(write(tmp_path, yaml.safe_dump(data)))]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: policy:") and "exploration" in line and "explore_cap" in line
