"""``specpilot bench loop``: specpilot's routing vs. each static pool, on real vLLM.

A fleet of two engines (this machine's two cores), configured three ways. Four real
vLLM-CPU servers from the testbed, all with its compute knee
(``testbed.server.KNEE_TOKENS``): n-gram γ=4 and off, one of each bound to each core
(``VllmServer(cpus=)``). The same traffic goes to

- all n-gram: both n-gram servers, behind a gateway (least-in-flight);
- all off: both off servers, behind a gateway;
- specpilot: specpilot as ``serve`` runs it in routing mode (``controller.runtime``):
  its gateway with two pools, n-gram on core 0 and off on core 1, routing by the
  bandit's choice, its loop learning every half second (a fresh policy: its learning
  and exploration are part of the bill).

So each target has both cores, its pools on separate hardware (as routing mode's pools
are, and as the policy's ``per_arm`` topology assumes), and the same gateway hop; what
differs is which config serves each request. (Against a static pool of one server,
specpilot's two pools would have twice the hardware; and with vLLM's default binding
every server computes on core 0: docs/testbed.md.) The gateways share the load
generator's process. The traffic has phases, as production does: one stream, then
sixteen concurrent streams, then one again; each stream alternates the classes of
``MIX`` (``--mix``). The three
targets take turns within each phase (see ``SLICES``). Goodput is completion tokens per
wall-clock second of each target's own turns.

JSON: ``{"pools": {name: goodput}, "specpilot": goodput,
"ratios": {"vs_best_static_pool": …}, "phases": …}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.observations import RequestObservation
from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool
from controller.gateway.server import GatewayServer
from controller.runtime import assemble
from controller.settings import Settings
from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import KNEE_TOKENS, NGRAM_TUNING, SERVED_MODEL, VllmServer, parse_spec
from testbed.traffic import CLASSES, Mix, run_streams

RESULT = Path("bench/results/loop.json")


@dataclass(frozen=True)
class Phase:
    streams: int
    requests_each: int


MIX: Mix = (("code", 0.0), ("json", 1.0))
"""Each stream alternates greedy code completions, where n-gram lookup accepts 0.93 of its
drafts, and sampled JSON, where it drafts on most steps and accepts 0.08 (the testbed's
acceptance table, docs/testbed.md): a class that pays for speculation and one that pays
for its drafts, so which pool serves which class matters."""

PHASES = (Phase(1, 60), Phase(16, 12), Phase(1, 60))
# Each phase's requests per stream divide evenly into SLICES turns.
"""Quiet, busy, quiet: n-gram wins the quiet phases, off the busy one (with the knee)."""

SLICES = 4
"""Each phase runs in this many slices; targets take turns in each (n-gram, off,
specpilot, then the reverse), so a shared machine's background load falls on all alike.
On this VM the same pool's goodput moves by ±25 % from one few-second turn to the next,
so shorter, more turns average that out better than two long ones."""


CORES = ("0", "1")
"""The machine's cores: one server of each config is bound to each."""


def pool_settings(
    ngram_urls: list[str],
    off_urls: list[str],
    data_dir: Path,
    classes: tuple[str, ...] = ("code",),
    **extra: Any,
) -> Settings:
    """Two pools of the tiny model: n-gram γ=4 and no speculation (also the e2e loop
    test's fleet), the policy learning per class of ``classes``; ``extra`` sets other
    top-level settings."""
    tuning = dict(NGRAM_TUNING)
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": list(classes),
            "policy": {"min_dwell_s": 5.0},
            **extra,
            "fleet": {
                "pools": {
                    "ngram": {
                        "model": SERVED_MODEL,
                        "instances": ngram_urls,
                        "speculative_config": {
                            "method": "ngram", "num_speculative_tokens": 4, **tuning,
                        },
                        "proposers": {
                            "ngram": {"method": "ngram", "gamma": [4, 4], "tuning": tuning}
                        },
                    },
                    "off": {"model": SERVED_MODEL, "instances": off_urls},
                }
            },
        }
    )  # fmt: skip


class ArmTally:
    """The arms specpilot's gateway served, per phase and class (it hears every relayed
    request): ``"code ngram:4"`` → count."""

    def __init__(self) -> None:
        self.phase = 0
        self.counts: list[Counter[str]] = [Counter() for _ in PHASES]

    def __call__(self, observation: RequestObservation) -> None:
        arm = observation.arm or "unknown"
        self.counts[self.phase][f"{observation.workload_class} {arm}"] += 1


async def play(
    urls: dict[str, str], mix: Mix, tally: ArmTally | None = None
) -> dict[str, tuple[float, list[dict[str, float]]]]:
    """Run every phase against every target, interleaved; goodput overall and per phase."""
    tokens = {name: [0] * len(PHASES) for name in urls}
    seconds = {name: [0.0] * len(PHASES) for name in urls}
    for index, phase in enumerate(PHASES):
        if tally is not None:
            tally.phase = index
        each = phase.requests_each // SLICES
        for slice_ in range(SLICES):
            order = list(urls) if (index * SLICES + slice_) % 2 == 0 else list(urls)[::-1]
            for name in order:
                started = time.perf_counter()
                tokens[name][index] += await run_streams(
                    urls[name], phase.streams, each, seed=index * 100 + slice_ * 10, mix=mix
                )
                seconds[name][index] += time.perf_counter() - started
    return {
        name: (
            sum(tokens[name]) / sum(seconds[name]),
            [
                {"streams": p.streams, "goodput": t / s}
                for p, t, s in zip(PHASES, tokens[name], seconds[name], strict=True)
            ],
        )
        for name in urls
    }


async def play_with_specpilot(
    settings: Settings, pools: dict[str, list[str]], mix: Mix, tally: ArmTally
) -> dict[str, tuple[float, list[dict[str, float]]]]:
    """Serve a static gateway per config (over all its servers) and specpilot as
    ``serve`` runs it (``controller.runtime``: its gateway routing by the bandit over
    the servers ``settings`` name, its loop learning every interval), and play."""
    runtime = assemble(settings, observe=tally)
    gateways = {
        name: Gateway(Fleet([Pool(name, name, urls)], clock=time.monotonic))
        for name, urls in pools.items()
    }
    # The gateway's own front end, as `specpilot gateway` runs it.
    servers = {
        name: await GatewayServer.start(gateway, host="127.0.0.1", port=0)
        for name, gateway in gateways.items()
    }
    await runtime.start(_loopback_socket(), _loopback_socket(), log_level="warning")
    urls = {name: f"http://127.0.0.1:{server.port}" for name, server in servers.items()}
    urls["specpilot"] = f"http://127.0.0.1:{runtime.gateway_port}"
    try:
        return await play(urls, mix, tally)
    finally:
        for server in servers.values():
            await server.close(grace_s=5.0)  # also closes its upstream connections
        await runtime.stop(grace_s=5.0)
        runtime.close()


def _loopback_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def run_benchmark(mix: Mix = MIX) -> dict[str, Any]:
    env, models = VllmEnvironment.default().ensure(), ModelSet.default()
    models.ensure(env)
    with contextlib.ExitStack() as stack:
        pools: dict[str, list[str]] = {}
        for spec in ("ngram:4", "off"):
            for cpus in CORES:
                server = VllmServer(
                    env, models, parse_spec(spec, models), batch_tokens=KNEE_TOKENS, cpus=cpus
                )
                stack.enter_context(server)
                pools.setdefault(spec.partition(":")[0], []).append(server.base_url)
                # Warm it so the first measured run does not pay its first requests.
                asyncio.run(run_streams(server.base_url, 2, 2, seed=10_000))
        data_dir = stack.enter_context(tempfile.TemporaryDirectory())
        # specpilot's fleet: n-gram on the first core, off on the second.
        settings = pool_settings(
            pools["ngram"][:1],
            pools["off"][1:],
            Path(data_dir),  # fresh: learning is billed
            classes=tuple(dict.fromkeys(workload for workload, _ in mix)),
            actuators={"mode": "routing"},
            scrape_interval_s=0.5,
        )
        tally = ArmTally()
        played = asyncio.run(play_with_specpilot(settings, pools, mix, tally))
    static = {name: played[name][0] for name in ("ngram", "off")}
    best = max(static, key=lambda name: static[name])
    specpilot = played["specpilot"][0]
    return {
        "pools": static,
        "specpilot": specpilot,
        "best_static_pool": best,
        "ratios": {"vs_best_static_pool": specpilot / static[best]},
        "phases": {name: phases for name, (_, phases) in played.items()},
        "specpilot_arms": [dict(sorted(counts.items())) for counts in tally.counts],
        "workload": [{"streams": p.streams, "requests_each": p.requests_each} for p in PHASES],
        "mix": [{"class": workload, "temperature": t} for workload, t in mix],
        "batch_tokens": KNEE_TOKENS,
        "servers_per_pool": len(CORES),
    }


def parse_mix(text: str) -> Mix:
    """``code:0,json:1`` → ``(("code", 0.0), ("json", 1.0))``."""
    mix = []
    for item in text.split(","):
        workload, _, temperature = item.strip().partition(":")
        if workload not in CLASSES:
            raise argparse.ArgumentTypeError(
                f"unknown workload class {workload!r}: use one of {', '.join(CLASSES)}"
            )
        try:
            mix.append((workload, float(temperature or 0.0)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the temperature is not a number") from None
    return tuple(mix)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=MIX,
        metavar="CLASS:T,...",
        help="the requests each stream cycles through, as workload class:temperature "
        "(default: code:0,json:1; code:0 is the single-class traffic of earlier figures)",
    )
    parser.set_defaults(func=run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``loop`` to the ``bench`` sub-command group."""
    add_arguments(
        subparsers.add_parser("loop", help="specpilot routing vs. static pools, real vLLM")
    )


def run(args: argparse.Namespace) -> int:
    result = run_benchmark(args.mix)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for name, goodput in result["pools"].items():
        print(f"static pool {name:6s} {goodput:8.1f} tokens/s")
    print(f"specpilot          {result['specpilot']:8.1f} tokens/s")
    for index, phase in enumerate(result["workload"]):
        figures = "  ".join(
            f"{name} {phases[index]['goodput']:7.1f}" for name, phases in result["phases"].items()
        )
        arms = ", ".join(f"{arm} ×{n}" for arm, n in result["specpilot_arms"][index].items())
        print(f"  phase {index} ({phase['streams']:2d} streams): {figures}  [specpilot: {arms}]")
    ratio = result["ratios"]["vs_best_static_pool"]
    print(f"specpilot / best static pool ({result['best_static_pool']}) = {ratio:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
