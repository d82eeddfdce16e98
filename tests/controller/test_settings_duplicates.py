"""A key given twice anywhere in the settings file is refused (``config check`` and
``serve``, exit 2, the key and both lines named): PyYAML would keep the last silently,
so a pool written twice would lose one."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import main
from controller.settings import SettingsError, duplicate_keys, load_settings

POOLS_TWICE = """\
store: {url: "sqlite:///x.db"}
classes: [code, chat]
fleet:
  pools:
    chat: {model: m, instances: ["http://127.0.0.1:9"]}
    code: {model: m, instances: ["http://127.0.0.1:9"]}
    chat: {model: m2, instances: ["http://127.0.0.1:9"]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "specpilot.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", [["config", "check"], ["serve", "--config"]])
def test_a_pool_given_twice_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    code = main([*command, str(write(tmp_path, POOLS_TWICE))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "error: fleet.pools.chat: given twice (lines 5 and 7); give it once "
        "(YAML would keep the last and drop the first silently)"
    ]


def test_json_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = main(["config", "check", "--json", str(write(tmp_path, POOLS_TWICE))])
    result = json.loads(capsys.readouterr().out)
    assert code == 2 and result["ok"] is False
    assert [e["key"] for e in result["errors"]] == ["fleet.pools.chat"]


def test_duplicates_are_found_at_every_depth_and_inside_lists() -> None:
    text = """\
scrape_interval_s: 1
fleet:
  pools:
    p:
      model: m
      model: m
      proposers:
        ngram: {method: ngram, gamma: [1, 4], method: ngram}
items:
  - {a: 1, a: 2}
scrape_interval_s: 2
"""
    assert [key for key, _ in duplicate_keys(text)] == [
        "fleet.pools.p.model",
        "fleet.pools.p.proposers.ngram.method",
        "items.0.a",
        "scrape_interval_s",
    ]


def test_what_yaml_keeps_apart_is_not_a_duplicate() -> None:
    text = """\
base: &base {model: m, max_num_seqs: 8}
pools:
  a: {<<: *base, model: other}
  b: *base
  c: *base
keys: {1: int, "1": str}
"""
    assert duplicate_keys(text) == []


def test_a_settings_file_without_duplicates_loads(tmp_path: Path) -> None:
    text = POOLS_TWICE.replace("    chat: {model: m2", "    rag: {model: m2").replace(
        "[code, chat]", "[code, chat, rag]"
    )
    assert sorted(load_settings(write(tmp_path, text), environ={}).fleet.pools) == [
        "chat",
        "code",
        "rag",
    ]
    with pytest.raises(SettingsError) as refused:
        load_settings(write(tmp_path, POOLS_TWICE), environ={})
    assert refused.value.errors[0][0] == "fleet.pools.chat"
