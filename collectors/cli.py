"""``specpilot metrics FILE [LATER_FILE] [--json]``: window statistics of /metrics dumps.

One dump gives the statistics since the worker process started; two dumps of the same
worker give the window between them. Exit status 0 on success, 2 when a file cannot be
read or is not Prometheus exposition text (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from collectors.exposition import ExpositionError, WorkerSnapshot, parse_exposition
from collectors.window import WindowStats, worker_json, worker_window


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "metrics",
        help="speculative-decoding window statistics from vLLM /metrics dumps",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("file", type=Path, help="a /metrics dump (stats since process start)")
    parser.add_argument(
        "later_file",
        type=Path,
        nargs="?",
        help="a later dump of the same worker: report the window between the two",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        first = _read(args.file)
        later = _read(args.later_file) if args.later_file is not None else None
    except _Unreadable as error:
        print(f"specpilot metrics: {error}", file=sys.stderr)
        return 2
    window = worker_window(first, later) if later is not None else worker_window(None, first)
    if args.json:
        print(json.dumps(worker_json(window), indent=2))
        return 0
    names = list(window.models)
    if len(names) <= 1:
        print(_describe(window.total, names[0] if names else "(no vLLM series)"))
    else:
        for name, model in window.models.items():
            print(_describe(model.total, name))
    return 0


class _Unreadable(Exception):
    pass


def _read(path: Path) -> WorkerSnapshot:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise _Unreadable(f"{path}: {_one_line(error)}") from None
    try:
        return parse_exposition(text)
    except ExpositionError as error:
        raise _Unreadable(f"{path}: {error}") from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _describe(stats: WindowStats, model: str) -> str:
    def number(value: float | None, digits: int = 3) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    lines = [f"model {model}" + ("  (worker restarted: new process only)" if stats.reset else "")]
    spec = stats.spec
    if spec is None:
        lines.append("  speculation            off (no spec-decode series)")
    else:
        positions = " ".join(number(p, 2) for p in spec.per_position_acceptance) or "n/a"
        lines += [
            f"  drafts                 {spec.drafts:.0f}",
            f"  draft tokens           {spec.draft_tokens:.0f}"
            f"  ({number(spec.mean_proposed_tokens_per_draft, 2)} per draft)",
            f"  accepted tokens        {spec.accepted_tokens:.0f}",
            f"  acceptance rate        {number(spec.acceptance_rate)}",
            f"  mean acceptance length {number(spec.mean_acceptance_length)}",
            f"  per-position accept.   {positions}",
        ]
    lines.append(f"  generation tokens/s    {number(stats.generation_tokens_per_s, 1)}")
    lines.append(
        f"  running / waiting      {number(stats.running.latest, 0)} / "
        f"{number(stats.waiting.latest, 0)}   KV cache {number(stats.kv_cache_usage.latest)}"
    )
    for label, latency in (
        ("ITL per step", stats.inter_token_latency),
        ("time per output token", stats.time_per_output_token),
    ):
        if latency is not None and latency.count > 0:
            lines.append(
                f"  {label:<22} mean {number(latency.mean_s, 4)} s  p50 {number(latency.p50_s, 4)}"
                f"  p90 {number(latency.p90_s, 4)}  p99 {number(latency.p99_s, 4)}"
            )
    return "\n".join(lines)
