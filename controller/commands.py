"""``specpilot config check FILE`` and ``specpilot serve --config FILE``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from controller.settings import Settings, SettingsError, load_settings, summary


def register(subparsers: Any) -> None:
    config = subparsers.add_parser("config", help="work with specpilot settings files")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser(
        "check", help="validate a settings file (with the environment) without starting anything"
    )
    check.add_argument("file", type=Path)
    check.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"ok", "file", "errors": [{"key", "message"}], "summary"}',
    )
    check.set_defaults(func=config_check)

    serve = subparsers.add_parser("serve", help="run the control loop and the REST API")
    serve.add_argument("--config", type=Path, required=True, help="settings YAML file")
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text (default) or one JSON object each (controller/actions.py)",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="debug adds one line per scrape and HTTP call",
    )
    serve.set_defaults(func=serve_command)


def _check(path: Path) -> tuple[Settings | None, list[tuple[str | None, str]]]:
    """The settings, or None and the errors as (key, problem), key None for the file.

    The policy is built too (nothing starts): its parameters (``policy.params``) are
    checked by the policy itself, which only then knows which keys it takes.
    """
    try:
        settings = load_settings(path)
    except SettingsError as exc:
        return None, exc.errors
    from controller.builtin import policy_from

    try:
        policy_from(settings)
    except (ValueError, TypeError) as exc:
        return None, [("policy", str(exc))]
    return settings, []


def _load_or_report(path: Path) -> Settings | None:
    """The settings, or None after printing one ``error: key: problem`` line per error."""
    settings, errors = _check(path)
    for key, problem in errors:
        print(f"error: {problem}" if key is None else f"error: {key}: {problem}", file=sys.stderr)
    return settings


def config_check(args: argparse.Namespace) -> int:
    """Exit 0 with a summary, or 2 with one line per error naming the key (``--json``:
    the same as one JSON object on stdout, exit codes alike)."""
    if args.json:
        settings, errors = _check(args.file)
        result = {
            "ok": settings is not None,
            "file": str(args.file),
            "errors": [{"key": key, "message": problem} for key, problem in errors],
            "summary": summary(settings) if settings is not None else [],
        }
        print(json.dumps(result, indent=2))
        return 0 if settings is not None else 2
    settings = _load_or_report(args.file)
    if settings is None:
        return 2
    print(f"{args.file}: OK")
    for line in summary(settings):
        print(f"  {line}")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    from controller.serve import serve  # the service stack loads only when it is run

    settings = _load_or_report(args.config)
    if settings is None:
        return 2
    code: int = serve(settings, log_format=args.log_format, log_level=args.log_level)
    return code
