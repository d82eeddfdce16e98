"""specpilot's own actions on record: one structured log line per thing it did or saw
happen to the fleet, on the logger ``specpilot.actions``.

Every line names its ``action`` (one of ``Action``) and carries its fields (pool, arm,
context, reason, …) both in the text and, with ``--log-format json``, as JSON keys, so
an operator can grep the text or feed the JSON to a log pipeline. HTTP lines of the
collectors (one per scrape) are DEBUG; these are INFO (WARNING where something failed).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from enum import StrEnum
from typing import Literal

ACTIONS = logging.getLogger("specpilot.actions")

LogFormat = Literal["text", "json"]
FieldValue = str | int | float | bool | None


class Action(StrEnum):
    """What happened; the README lists these with what each line carries."""

    DECISION = "decision"
    """A context's arm changed (``context``, ``arm``, ``previous_arm``, ``reason``, ``actor``)."""
    PUSH = "push"
    """A pool's config handed to an actuator (``pool``, ``actuator``, ``config``, ``outcome``)."""
    PUSH_CONFIRMED = "push_confirmed"
    """What vLLM reports shows the pushed config running (``pool``, ``arm``)."""
    PUSH_NOT_APPLIED = "push_not_applied"
    """No evidence of a push in time (``pool``, ``pushed``, ``running``)."""
    OVERRIDE_SET = "override_set"
    """An operator pinned an arm (``override``, ``scope``, ``config``)."""
    OVERRIDE_ENDED = "override_ended"
    """An override was deleted or expired (``override``)."""
    ROLLBACK = "rollback"
    """A push failed and the old config serves (``pool``, ``actuator``, ``error``)."""
    INSTANCE_DOWN = "instance_down"
    """An instance stopped answering or serves another model (``pool``, ``instance``,
    ``reason``: ``unreachable``, ``bad_answer`` or ``wrong_model``; ``served``: its names)."""
    INSTANCE_UP = "instance_up"
    """An instance that was down answers again (``pool``, ``instance``)."""
    FAILOVER = "failover"
    """Routing mode: requests the routing table sent to a pool that could not take them
    (no instance up), served by another pool (``routed_arm``, ``served_pool``,
    ``requests``); one line per iteration and pair where any were."""
    ALERT_RAISED = "alert_raised"
    """An alert fired (``alert``, ``severity``, ``context``)."""
    ALERT_RESOLVED = "alert_resolved"
    """A firing alert's condition cleared (``alert``, ``context``)."""


_WARNINGS = frozenset(
    {Action.PUSH_NOT_APPLIED, Action.ROLLBACK, Action.INSTANCE_DOWN, Action.FAILOVER}
)


def record(action: Action, message: str, /, **fields: FieldValue) -> None:
    """Log one action: ``message`` for a reader, ``fields`` for a machine."""
    level = logging.WARNING if action in _WARNINGS else logging.INFO
    if action is Action.ALERT_RAISED and fields.get("severity") == "critical":
        level = logging.WARNING
    if not ACTIONS.isEnabledFor(level):
        return
    shown = {k: v for k, v in fields.items() if v is not None}
    text = " ".join(f"{k}={_text(v)}" for k, v in shown.items())
    ACTIONS.log(
        level,
        "%s: %s%s",
        action.value,
        message,
        f" [{text}]" if text else "",
        extra={"action": action.value, "fields": shown},
    )


def _text(value: FieldValue) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' =[]"')) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message`` and, for an
    action line, ``action`` and its fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        action = getattr(record, "action", None)
        if action is not None:
            entry["action"] = action
            for key, value in getattr(record, "fields", {}).items():
                if isinstance(value, float) and not math.isfinite(value):
                    value = str(value)
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: LogFormat = "text", level: int = logging.INFO) -> None:
    """The process's logging: text (the default) or JSON lines on stderr. The HTTP
    clients' per-request lines (one per scrape and push) go to DEBUG."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    quiet = logging.DEBUG if level <= logging.DEBUG else logging.WARNING
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(quiet)
