"""``specpilot bench api``: how long the REST API takes to answer while the loop works.

specpilot's API and its control loop share one event loop; an operator reading
``/v1/policy`` or a readiness probe asking ``/readyz`` must not wait for an iteration
(the policy's planning takes seconds under load). This runs the real service
(``controller.serve.serve``, what ``specpilot serve`` runs, in a process of its own) in
routing mode, its gateway in front of a simulated fleet (a second process:
``simulator.server.SimFleet`` and the closed-loop load generator), with many contexts
(``--classes`` workload classes × six concurrency buckets) and every request through
the gateway an observation the loop learns from. The benchmark's own process sends,
every ``--interval-s``, ``--fanout`` concurrent GETs of each path at once (loopback
only), for at most ``--rounds`` rounds or ``--seconds``, twice side by side:

- idle: the loop iterates every second with no traffic;
- loaded: the load generator's streams flow through the gateway (after ``--warmup-s``,
  so that every iteration learns from many observations).

It prints p50 and p99 of each path in both phases, their ratio (loaded over idle) and
what the loop did meanwhile (iterations, observations per iteration, mean iteration
time, from the service's ``/metrics``). ``/healthz``, answered by the event loop alone,
is measured beside them as the floor this machine allows. Goal: p99 of ``/v1/policy``
and ``/readyz`` under ``TARGET_P99_MS`` while loaded.

JSON (``bench/results/api.json``): ``{"idle": {path: figures}, "loaded": {...},
"ratios": {path: {"p50": …, "p99": …}}, "loop": {"idle": …, "loaded": …},
"meets_target": …}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controller.settings import Settings

RESULT = Path("bench/results/api.json")
PATHS = ("/v1/policy", "/readyz")
FLOOR = "/healthz"
"""Measured beside ``PATHS``: what any answer costs on this machine at the time."""
TARGET_P99_MS = 100.0
CLASSES = ("code", "chat", "rag", "creative", "json", "structured", "edit", "summary")
"""Workload class names; ``--classes N`` takes the first N (more are numbered)."""
STREAM_LEVELS = (2, 6, 12, 24, 48)
"""The load's concurrency cycles through these, so requests land in every bucket."""


def scenario_data(classes: int, duration_s: float, streams: int) -> dict[str, Any]:
    """A simulated fleet (off, EAGLE-3 and n-gram pools) whose traffic cycles through
    the concurrency levels, of ``classes`` classes with different acceptances."""
    names = [*CLASSES, *(f"class{i}" for i in range(len(CLASSES), classes))][:classes]
    levels = [min(level, streams) for level in STREAM_LEVELS]
    step = duration_s / (2 * len(levels))
    return {
        "seed": 11,
        "duration_s": duration_s,
        "model": {"step_ms": 30, "knee_tokens": 64},
        "proposers": {
            "eagle3": {"draft_cost": 0.05, "gammas": [2, 4, 6]},
            "ngram": {"draft_cost": 0.005, "gammas": [2, 4]},
        },
        "classes": {
            name: {
                "share": 1 / classes,
                "output_tokens": 64,
                "acceptance": {"eagle3": 0.45 + 0.4 * i / classes, "ngram": 0.6 * i / classes},
            }
            for i, name in enumerate(names)
        },
        "phases": [
            {"at_s": k * step, "concurrency": levels[k % len(levels)]}
            for k in range(2 * len(levels))
        ],
    }


# -- the load source's process ---------------------------------------------------------


def _fleet_and_load(data: dict[str, Any], speed: float, conn: Connection) -> None:
    asyncio.run(_fleet_and_load_async(data, speed, conn))


async def _fleet_and_load_async(data: dict[str, Any], speed: float, conn: Connection) -> None:
    """Serve the simulated fleet, send its URLs, then run the load each ``("load", url,
    seconds)`` asks for (answering with what it did) until ``("stop",)``."""
    from simulator.load import LoadOptions, run_load
    from simulator.scenario import parse_scenario
    from simulator.server import SimFleet, default_pools

    scenario = parse_scenario(data)
    pools = default_pools(scenario)
    fleet = SimFleet(scenario, pools, speed=speed)
    await fleet.start()
    try:
        conn.send({pool.name: fleet.urls(pool.name) for pool in pools})
        loop = asyncio.get_running_loop()
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message[0] != "load":
                return
            _, url, seconds = message
            options = LoadOptions(speed=speed, max_requests=10**7, max_duration_s=seconds)
            report = await run_load(url, scenario, options, rng=random.Random(scenario.seed))
            conn.send({"completed": report.completed, "failed": report.failed})
    finally:
        await fleet.stop()


# -- the service's process -------------------------------------------------------------


SERVE_LOG = "serve.log"


def _serve(settings: Settings) -> None:
    """``specpilot serve``, its output (an access-log line per request) in ``SERVE_LOG``
    under its data directory rather than on the benchmark's terminal."""
    from controller.serve import serve

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with open(settings.data_dir / SERVE_LOG, "ab") as log:
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    serve(settings, log_level="warning")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_settings(
    scenario: dict[str, Any], urls: dict[str, list[str]], data_dir: Path
) -> Settings:
    """The settings ``serve`` would read: routing mode over the simulated pools, its
    gateway with one worker (this machine has two cores), a loop every second."""
    from controller.demo import demo_settings
    from simulator.scenario import parse_scenario
    from simulator.server import default_pools

    parsed = parse_scenario(scenario)
    args = argparse.Namespace(data_dir=data_dir, port=free_port())
    settings = demo_settings(parsed, default_pools(parsed), urls, args, environ={})
    gateway = settings.gateway.model_copy(update={"port": free_port(), "workers": 1})
    return settings.model_copy(update={"gateway": gateway})


# -- the probe -------------------------------------------------------------------------


@dataclass
class Latencies:
    seconds: list[float]
    errors: int = 0

    def quantile(self, q: float) -> float | None:
        """Nearest rank: the smallest latency at or above a share ``q`` of them."""
        if not self.seconds:
            return None
        ordered = sorted(self.seconds)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def figures(self) -> dict[str, Any]:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(1000 * value, 2)

        return {
            "requests": len(self.seconds),
            "errors": self.errors,
            "p50_ms": ms(self.quantile(0.5)),
            "p99_ms": ms(self.quantile(0.99)),
            "max_ms": ms(max(self.seconds, default=None)),
        }


async def probe(
    base_url: str,
    paths: tuple[str, ...],
    *,
    fanout: int,
    interval_s: float,
    rounds: int,
    seconds: float,
) -> dict[str, Latencies]:
    """Rounds of ``fanout`` concurrent GETs of every path at once, a round every
    ``interval_s`` (or as soon as the last one answered, if later), until ``rounds``
    rounds or ``seconds`` passed: an operator's, a dashboard's and a readiness probe's
    requests arriving together, not a saturating stream. Each request's time to its
    full answer."""
    found = {path: Latencies([]) for path in paths}
    deadline = time.monotonic() + seconds

    async def get(http: httpx.AsyncClient, path: str) -> None:
        started = time.perf_counter()
        try:
            response = await http.get(path)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        found[path].seconds.append(time.perf_counter() - started)
        found[path].errors += not ok

    limits = httpx.Limits(max_connections=fanout * len(paths))
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, limits=limits) as http:
        for _ in range(rounds):
            if time.monotonic() >= deadline:
                break
            started = time.monotonic()
            await asyncio.gather(*(get(http, path) for path in paths for _ in range(fanout)))
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    return found


def loop_counters(base_url: str) -> dict[str, float]:
    """The loop's iterations, observations and time spent iterating, from ``/metrics``."""
    text = httpx.get(f"{base_url}/metrics", timeout=60.0).text
    counters = {"iterations": 0.0, "observations": 0.0, "iteration_s": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specpilot_loop_iterations_total":
                counters["iterations"] = sample.value
            elif sample.name == "specpilot_observations_total":
                counters["observations"] = sample.value
            elif sample.name == "specpilot_loop_iteration_duration_seconds_sum":
                counters["iteration_s"] = sample.value
    return counters


def loop_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    iterations = after["iterations"] - before["iterations"]
    observations = after["observations"] - before["observations"]
    spent = after["iteration_s"] - before["iteration_s"]
    return {
        "iterations": iterations,
        "observations": observations,
        "observations_per_iteration": observations / iterations if iterations else None,
        "mean_iteration_s": spent / iterations if iterations else None,
    }


def measure(
    base_url: str, args: argparse.Namespace, paths: tuple[str, ...], before: dict[str, float]
) -> tuple[dict[str, Latencies], dict[str, float | None]]:
    """Probe the paths; what the loop did since ``before`` (its counters then)."""
    started = time.monotonic()
    found = asyncio.run(
        probe(
            base_url,
            paths,
            fanout=args.fanout,
            interval_s=args.interval_s,
            rounds=args.rounds,
            seconds=args.seconds,
        )
    )
    loop = loop_figures(before, loop_counters(base_url))
    loop["probed_s"] = time.monotonic() - started
    return found, loop


def wait_ready(base_url: str, process: multiprocessing.process.BaseProcess, log: Path) -> None:
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if not process.is_alive():
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"specpilot serve exited ({process.exitcode}):\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/readyz", timeout=5.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("specpilot serve did not become ready in 120 s")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    goal = tuple(args.paths)
    paths = (*goal, FLOOR) if FLOOR not in goal else goal
    spawn = multiprocessing.get_context("spawn")
    load_s = args.warmup_s + args.seconds + 2.0  # the loaded probe ends within it
    scenario = scenario_data(args.classes, load_s * args.speed, args.streams)
    ours, theirs = spawn.Pipe()
    load = spawn.Process(target=_fleet_and_load, args=(scenario, args.speed, theirs), daemon=True)
    load.start()
    service: multiprocessing.process.BaseProcess | None = None
    try:
        urls = ours.recv()
        with tempfile.TemporaryDirectory() as data_dir:
            settings = service_settings(scenario, urls, Path(data_dir))
            service = spawn.Process(target=_serve, args=(settings,))
            service.start()
            base_url = f"http://127.0.0.1:{settings.api.port}"
            gateway_url = f"http://127.0.0.1:{settings.gateway.port}"
            wait_ready(base_url, service, settings.data_dir / SERVE_LOG)
            time.sleep(3 * settings.scrape_interval_s)  # a few idle iterations first
            idle, idle_loop = measure(base_url, args, paths, loop_counters(base_url))
            before_load = loop_counters(base_url)
            ours.send(("load", gateway_url, load_s))
            time.sleep(args.warmup_s)
            loaded, loaded_loop = measure(base_url, args, paths, before_load)
            traffic = ours.recv()
            service.terminate()  # SIGTERM: a clean stop
            service.join(60.0)
    finally:
        with contextlib.suppress(OSError, BrokenPipeError):
            ours.send(("stop",))
        load.join(30.0)
        if load.is_alive():
            load.kill()
        if service is not None and service.is_alive():
            service.kill()
    contexts = args.classes * len(settings.buckets)
    result: dict[str, Any] = {
        "contexts": contexts,
        "classes": args.classes,
        "streams": args.streams,
        "fanout": args.fanout,
        "interval_s": args.interval_s,
        "target_p99_ms": TARGET_P99_MS,
        "idle": {path: idle[path].figures() for path in paths},
        "loaded": {path: loaded[path].figures() for path in paths},
        "loop": {"idle": idle_loop, "loaded": loaded_loop},
        "traffic": traffic,
    }
    ratios = {}
    for path in paths:
        pair = {}
        for q in ("p50", "p99"):
            before, after = result["idle"][path][f"{q}_ms"], result["loaded"][path][f"{q}_ms"]
            pair[q] = after / before if before and after is not None else None
        ratios[path] = pair
    result["ratios"] = ratios
    result["meets_target"] = all(
        (p99 := result["loaded"][path]["p99_ms"]) is not None
        and p99 < TARGET_P99_MS
        and not result["loaded"][path]["errors"]
        for path in goal
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--classes", type=int, default=len(CLASSES), help="workload classes")
    parser.add_argument("--streams", type=int, default=48, help="most concurrent load streams")
    parser.add_argument("--speed", type=float, default=10.0, help="the simulated fleet's speed")
    parser.add_argument("--fanout", type=int, default=1, help="concurrent GETs of each path")
    parser.add_argument("--interval-s", type=float, default=0.05, help="between rounds of GETs")
    parser.add_argument("--rounds", type=int, default=400, help="rounds of GETs, at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="at most, per phase")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="load before measuring")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), help="paths with the goal")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.set_defaults(func=run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``api`` to the ``bench`` sub-command group."""
    add_arguments(
        subparsers.add_parser("api", help="API latency while the loop ticks under load vs. idle")
    )


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value:7.1f}"


def run(args: argparse.Namespace) -> int:
    result = run_benchmark(args)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['contexts']} contexts, load up to {result['streams']} streams through the")
    print(
        f"gateway ({result['traffic']['completed']} requests); every {args.interval_s:g} s "
        f"{args.fanout} concurrent GET(s) of each path"
    )
    for phase in ("idle", "loaded"):
        loop = result["loop"][phase]
        per = loop["observations_per_iteration"]
        mean = loop["mean_iteration_s"]
        print(
            f"loop {phase:6s}: {loop['iterations']:.0f} iterations done, "
            f"{'-' if per is None else f'{per:.0f}'} observations each, "
            f"{'-' if mean is None else f'{1000 * mean:.0f}'} ms each on average"
        )
    print(f"{'path':18s} {'idle p50':>9s} {'idle p99':>9s} {'load p50':>9s} {'load p99':>9s}"
          f" {'p99 load/idle':>14s}")  # fmt: skip
    for path in result["idle"]:
        idle, loaded = result["idle"][path], result["loaded"][path]
        label = f"{path} (floor)" if path == FLOOR else path
        ratio = result["ratios"][path]["p99"]
        errors = loaded["errors"] + idle["errors"]
        print(
            f"{label:18s} {_ms(idle['p50_ms'])} ms {_ms(idle['p99_ms'])} ms "
            f"{_ms(loaded['p50_ms'])} ms {_ms(loaded['p99_ms'])} ms "
            f"{'-' if ratio is None else f'{ratio:13.2f}x'}"
            + (f"  ({errors} errors)" if errors else "")
        )
    verdict = "met" if result["meets_target"] else "MISSED"
    print(f"goal: p99 of {', '.join(args.paths)} < {TARGET_P99_MS:.0f} ms while loaded: {verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
