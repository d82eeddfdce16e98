"""Scale benchmark of the collectors: can one core keep up with a 500-worker fleet?

Each scrape round parses one ``/metrics`` page per worker and computes that worker's
window against its previous page — what the scraper does every interval. Pages are a
recorded real vLLM 0.32 page (``tests/fixtures/vllm-0.32``, or ``--page``), one variant
per worker with all sample values scaled, so every page has the recorded size and
shape. Reported, measured side by side in one run (CPU time, best of ``--rounds``):

- CPU seconds per round and the share of one core at the 15 s scrape interval
  (goal: 500 workers under 20 %);
- specpilot's parse + window over a bare ``prometheus_client`` parse of the same pages.

``python -m bench.scale [--json]``; the result is also written to
``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from collectors.exposition import parse_exposition
from collectors.window import worker_window

SCRAPE_INTERVAL_S = 15.0
GOAL_CORE_SHARE = 0.20
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32"
RESULT = ROOT / "bench" / "results" / "scale.json"
_VALUE = re.compile(r"^([^#\s][^ ]*(?:\{.*\})?) (\S+)$", re.MULTILINE)


def default_page() -> Path | None:
    """The largest recorded page: the one after traffic, with speculation."""
    pages = [path for path in FIXTURES.glob("**/*") if path.is_file() and _is_page(path)]
    return max(pages, key=lambda path: path.stat().st_size, default=None)


def _is_page(path: Path) -> bool:
    head = path.read_bytes()[:4096]
    return b"# TYPE vllm:" in head or b"\nvllm:" in head


def scaled(page: str, factor: float) -> str:
    """The page with every sample value multiplied by ``factor``: same lines, same size
    class, still valid (cumulative buckets stay cumulative)."""

    def scale(match: re.Match[str]) -> str:
        try:
            value = float(match.group(2)) * factor
        except ValueError:
            return match.group(0)
        return f"{match.group(1)} {value!r}"

    return _VALUE.sub(scale, page)


def cpu_seconds(work: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best


@dataclass(frozen=True)
class ScaleResult:
    page: str
    page_bytes: int
    page_lines: int
    workers: int
    rounds: int
    specpilot_round_cpu_s: float
    """CPU seconds to parse every worker's page and compute its window, best round."""
    bare_parse_round_cpu_s: float
    """CPU seconds for prometheus_client alone to parse the same pages, best round."""
    scrape_interval_s: float = SCRAPE_INTERVAL_S
    goal_core_share: float = GOAL_CORE_SHARE

    @property
    def core_share(self) -> float:
        """Share of one core the collectors need at the scrape interval."""
        return self.specpilot_round_cpu_s / self.scrape_interval_s

    @property
    def specpilot_over_bare(self) -> float | None:
        if self.bare_parse_round_cpu_s <= 0:
            return None
        return self.specpilot_round_cpu_s / self.bare_parse_round_cpu_s

    def as_json(self) -> dict[str, object]:
        return asdict(self) | {
            "core_share_at_interval": self.core_share,
            "specpilot_over_bare_parse_ratio": self.specpilot_over_bare,
            "meets_goal": self.core_share < self.goal_core_share,
        }


def run(page_path: Path, workers: int, rounds: int) -> ScaleResult:
    template = page_path.read_text(encoding="utf-8")
    # Each worker's previous scrape, already parsed (as the scraper keeps it), and its
    # new page, as text (as it arrives).
    previous = [
        parse_exposition(scaled(template, 0.5 + 0.4 * i / workers), scraped_at=0.0)
        for i in range(workers)
    ]
    latest = [scaled(template, 1.0 + 0.01 * (i % 7)) for i in range(workers)]

    def specpilot_round() -> None:
        for before, page in zip(previous, latest, strict=True):
            worker_window(before, parse_exposition(page, scraped_at=15.0))

    def bare_round() -> None:
        for page in latest:
            for family in text_string_to_metric_families(page):
                for _ in family.samples:
                    pass

    return ScaleResult(
        page=str(page_path),
        page_bytes=len(template.encode()),
        page_lines=template.count("\n"),
        workers=workers,
        rounds=rounds,
        specpilot_round_cpu_s=cpu_seconds(specpilot_round, rounds),
        bare_parse_round_cpu_s=cpu_seconds(bare_round, rounds),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page", type=Path, help="a recorded vLLM /metrics page")
    parser.add_argument("--workers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3, help="repeats; the best is kept")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_cli)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``scale`` to the ``bench`` sub-command group."""
    add_arguments(subparsers.add_parser("scale", help="CPU per scrape round of 500 workers"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    page = args.page or default_page()
    if page is None:
        print(f"bench.scale: no recorded page under {FIXTURES}; pass --page", file=sys.stderr)
        return 2
    result = run(page, args.workers, args.rounds)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result.as_json(), indent=2) + "\n")
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        return 0
    verdict = "met" if result.core_share < result.goal_core_share else "MISSED"
    print(f"{result.workers} workers, page {result.page_bytes} bytes / {result.page_lines} lines")
    print(
        f"specpilot parse+window: {result.specpilot_round_cpu_s:.3f} CPU s per round"
        f" = {100 * result.core_share:.1f} % of one core at a {result.scrape_interval_s:.0f} s"
        f" interval (goal < {100 * result.goal_core_share:.0f} %: {verdict})"
    )
    ratio = result.specpilot_over_bare
    print(
        f"bare prometheus_client parse: {result.bare_parse_round_cpu_s:.3f} CPU s per round;"
        f" specpilot / bare = {'n/a' if ratio is None else f'{ratio:.2f}'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
