"""specpilot's action lines: one per action, its fields in the text and as JSON keys."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from controller import actions
from controller.actions import Action


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    actions.configure("text")


def _into(stream: io.StringIO, log_format: actions.LogFormat) -> None:
    actions.configure(log_format)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)


def test_a_text_line_names_the_action_and_its_fields(captured: io.StringIO) -> None:
    _into(captured, "text")
    actions.record(Action.PUSH_NOT_APPLIED, "pool a", pool="a", pushed="ngram:2", running=None)
    line = captured.getvalue().strip()
    assert "WARNING specpilot.actions: push_not_applied: pool a [pool=a pushed=ngram:2]" in line
    assert "running" not in line  # a field without a value is left out


def test_a_json_line_carries_the_fields_as_keys(captured: io.StringIO) -> None:
    _into(captured, "json")
    actions.record(
        Action.DECISION, "ctx: off -> ngram:2", context="m/code/1", reason="a b", speedup=1.5
    )
    entry = json.loads(captured.getvalue())
    assert entry["action"] == "decision"
    assert entry["level"] == "INFO"
    assert entry["context"] == "m/code/1"
    assert entry["reason"] == "a b"
    assert entry["speedup"] == 1.5
    assert entry["message"].startswith("decision: ctx: off -> ngram:2 [context=m/code/1")
    assert 'reason="a b"' in entry["message"]


def test_http_client_lines_show_only_at_debug(captured: io.StringIO) -> None:
    _into(captured, "text")
    logging.getLogger("httpx").info("HTTP Request: GET http://x/metrics 200 OK")
    assert captured.getvalue() == ""
    actions.configure("text", logging.DEBUG)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(captured)
    logging.getLogger("httpx").info("HTTP Request: GET http://x/metrics 200 OK")
    assert "GET http://x/metrics" in captured.getvalue()
