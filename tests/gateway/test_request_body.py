"""How the gateway asks vLLM for the usage chunk without changing anything else."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller.gateway.app import _with_usage

USAGE = {"include_usage": True, "continuous_usage_stats": False}


def rewrite(body: dict[str, Any], raw: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    raw = raw if raw is not None else json.dumps(body).encode()
    out = _with_usage(raw, dict(body), body.get("stream_options"))
    return out, json.loads(out)


def test_absent_options_are_spliced_into_the_clients_bytes() -> None:
    raw = b'{"model": "m", "prompt": "\\u00e9}", "stream": true}\n'
    out, parsed = rewrite(json.loads(raw), raw)
    assert out.startswith(raw.rstrip()[:-1])
    assert parsed == {**json.loads(raw), "stream_options": USAGE}


@pytest.mark.parametrize(
    "options",
    [{}, {"include_usage": False}, {"continuous_usage_stats": True}],
)
def test_client_options_are_kept_and_usage_turned_on(options: dict[str, Any]) -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": options}
    _, parsed = rewrite(body)
    assert parsed["stream_options"] == {**options, **USAGE}
    assert {k: v for k, v in parsed.items() if k != "stream_options"} == {
        k: v for k, v in body.items() if k != "stream_options"
    }


def test_explicit_null_options_are_replaced_not_duplicated() -> None:
    body = {"model": "m", "stream": True, "stream_options": None}
    out, parsed = rewrite(body)
    assert out.count(b"stream_options") == 1
    assert parsed["stream_options"] == USAGE
