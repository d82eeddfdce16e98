"""Settings that ``serve`` could not run are refused by ``config check``: exit 2, one
line naming the key, never a traceback; and the gateway's own settings keys."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.cli import main
from controller.gateway.server import GatewayLimits
from controller.gateway.upstream import UpstreamTimeouts
from controller.settings import load_settings
from tests.controller.test_settings_modes import routing


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: Any) -> tuple[int, str]:
    path = tmp_path / "s.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    code = main(["config", "check", str(path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def with_(base: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(base)
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


@pytest.mark.parametrize(
    ("dotted", "value", "key", "says"),
    [
        (
            "fleet.pools.plain.instances",
            ["https://127.0.0.1:9001"],
            "fleet.pools.plain.instances.0",
            "plain HTTP",
        ),
        (
            "fleet.pools.plain.instances",
            ["http://127.0.0.1:9001/v1"],
            "fleet.pools.plain.instances.0",
            "path",
        ),
        ("gateway.port", 8080, "gateway.port", "api.port too"),
        ("store.url", "mysql://u@127.0.0.1/db", "store.url", "unsupported database 'mysql'"),
        ("store.url", "postgresql+psycopg2://u@127.0.0.1/db", "store.url", "not installed"),
        ("store.url", "not a url", "store.url", "not a database URL"),
        (
            "fleet.pools.fast.proposers.ngram.gamma",
            [4, 1_000_000],
            "fleet.pools.fast.proposers.ngram.gamma",
            "more than vLLM verifies per step (128)",
        ),
        ("classes", ["code", ""], "classes", "non-empty"),
        ("classes", ["code", " chat"], "classes", "surrounding spaces"),
        ("classes", ["code", "code"], "classes", "distinct"),
        ("fleet.pools.plain.classes", ["code", "code"], "fleet.pools.plain.classes", "distinct"),
        ("scrape_interval_s", float("inf"), "scrape_interval_s", "finite"),
        ("scrape_interval_s", float("nan"), "scrape_interval_s", "finite"),
        ("scrape_interval_s", 0, "scrape_interval_s", "greater than 0"),
        ("policy.min_dwell_s", float("inf"), "policy.min_dwell_s", "finite"),
        ("leader.check_interval_s", -1, "leader.check_interval_s", "greater than 0"),
        ("gateway.limits.header_timeout_s", float("inf"), "gateway.limits.header_timeout_s", ""),
        ("gateway.limits.max_connections", 0, "gateway.limits.max_connections", ""),
        ("gateway.upstream_timeouts.first_byte_s", 0, "gateway.upstream_timeouts.first_byte_s", ""),
    ],
)
def test_settings_serve_could_not_run_exit_2_naming_the_key(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dotted: str,
    value: Any,
    key: str,
    says: str,
) -> None:
    code, err = check(tmp_path, capsys, with_(routing(), dotted, value))
    assert code == 2
    assert f"error: {key}: " in err and says in err, err


def test_instance_credentials_are_not_echoed_in_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = with_(routing(), "fleet.pools.plain.instances", ["https://ops:s3cret@127.0.0.1:9001"])
    code, err = check(tmp_path, capsys, data)
    assert code == 2 and "ops:***@" in err and "s3cret" not in err


def test_a_file_that_is_not_text_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    code = main(["config", "check", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "not a text file" in err and "Traceback" not in err


def test_keys_that_are_not_names_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = check(tmp_path, capsys, "1: x\nfleet: {}\n")
    assert code == 2 and "keys must be names" in err


def test_ports_apart_or_on_distinct_addresses_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    data = with_(with_(routing(), "api.host", "127.0.0.2"), "gateway.port", 8080)
    path.write_text(yaml.safe_dump(data))
    assert load_settings(path, environ={}).gateway.port == 8080
    # Push mode without the gateway: its port is not listened on, the instance not reached.
    push = {"fleet": {"pools": {"a": {"model": "m", "instances": ["https://vllm.example:443"]}}}}
    path.write_text(yaml.safe_dump(with_(push, "gateway.port", 8080)))
    assert load_settings(path, environ={}).fleet.pools["a"].instances == [
        "https://vllm.example:443"
    ]


def test_gateway_limits_and_upstream_timeouts_default_to_the_gateways_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(routing()))
    gateway = load_settings(path, environ={}).gateway
    assert gateway.limits.limits() == GatewayLimits()
    assert gateway.upstream_timeouts.timeouts() == UpstreamTimeouts()
    data = with_(routing(), "gateway.limits", {"max_body_bytes": 1 << 20, "body_timeout_s": 5})
    data = with_(data, "gateway.upstream_timeouts", {"between_chunks_s": 30})
    path.write_text(yaml.safe_dump(data))
    gateway = load_settings(path, environ={}).gateway
    assert gateway.limits.limits().max_body_bytes == 1 << 20
    assert gateway.limits.limits().body_timeout_s == 5
    assert gateway.upstream_timeouts.timeouts().between_chunks_s == 30
