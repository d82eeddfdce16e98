"""`specpilot gateway` argument handling (no server started)."""

from __future__ import annotations

import pytest

from controller.cli import build_parser
from controller.gateway.cli import parse_pools


def test_pools_and_arms_from_the_command_line() -> None:
    args = build_parser().parse_args(
        [
            "gateway",
            "--pool",
            "ngram=http://127.0.0.1:8001,http://127.0.0.1:8002",
            "--pool",
            "off=http://127.0.0.1:8003",
            "--arm",
            "ngram=ngram:4",
        ]
    )
    pools = parse_pools(args.pool, args.arm)
    assert [(p.name, p.arm) for p in pools] == [("ngram", "ngram:4"), ("off", "off")]
    assert [i.port for i in pools[0].instances] == [8001, 8002]
    assert args.func.__module__ == "controller.gateway.cli"


def test_malformed_pool_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_pools(["no-equals-sign"], [])


def test_an_instance_url_the_gateway_cannot_reach_is_a_message_not_a_traceback() -> None:
    with pytest.raises(SystemExit) as refused:
        parse_pools(["p=https://127.0.0.1:8001"], [])
    assert str(refused.value).startswith("--pool p: instance 'https://127.0.0.1:8001': scheme")
