"""Benchmark of the workload classifier: held-out macro-F1 and per-prompt latency.

Scores the shipped default model (trained on the train split of the committed default
dataset) on the held-out split — documents, templates and topics it never saw, see
:mod:`policies.classifier_data.generate` — side by side with two trivial baselines on
the same prompts: a majority-class guess and hand-written keyword rules. It times one
prediction per prompt, as the gateway makes them (no batching), and the retraining a
model file costs on load.

    python -m bench.classifier [--json] [--resplit-seeds N]
    specpilot bench classifier [--json] [--resplit-seeds N]

``--resplit-seeds N`` also rebuilds the dataset from this machine's material with N
seeds (each holding out other documents and templates) and reports the spread.

Writes the JSON result to bench/results/classifier.json as well.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sklearn.metrics import f1_score

from policies.classifier import (
    ClassifierRecipe,
    LabelledPrompt,
    WorkloadClassifier,
    default_recipe,
    train_classifier,
)
from policies.classifier_cli import collect_local_material
from policies.classifier_data import DEFAULT_SEED, load_default_dataset
from policies.classifier_data.generate import DatasetRow, build_dataset

RESULT_PATH = Path(__file__).resolve().parent / "results" / "classifier.json"

_CODE_PATTERN = re.compile(r"^\s*(def |class |import |#include|for \(|if \()|[;{}]\s*$", re.M)


_CREATIVE_WORDS = (
    "poem",
    "story",
    "tale",
    "song",
    "lyrics",
    "verse",
    "rhyme",
    "sonnet",
    "haiku",
    "imagine",
    "fiction",
    "fairy",
    "myth",
    "novel",
    "character",
)


def keyword_rules(prompt: str) -> str:
    """The baseline an operator would write by hand: first matching keyword rule wins."""
    text = prompt.lower()
    if "json" in text or "schema" in text or "yaml" in text:
        return "structured"
    if _CODE_PATTERN.search(prompt) or any(
        word in text for word in ("code", "function", "implement", "script", "bug", "program")
    ):
        return "code"
    if any(
        word in text
        for word in ("rewrite", "summar", "context", "passage", "text below", "proofread")
    ):
        return "edit"
    if any(word in text for word in _CREATIVE_WORDS):
        return "creative"
    return "chat"


@dataclass(frozen=True, slots=True)
class Scores:
    """F1 of one predictor on the held-out split; F1 values in [0, 1]."""

    macro_f1: float
    per_class_f1: dict[str, float]
    accuracy: float


def score(truth: Sequence[str], predicted: Sequence[str], classes: Sequence[str]) -> Scores:
    """Macro and per-class F1 (classes never predicted score 0, not an error)."""
    per_class = f1_score(truth, predicted, labels=list(classes), average=None, zero_division=0)
    correct = sum(t == p for t, p in zip(truth, predicted, strict=True))
    return Scores(
        macro_f1=float(per_class.mean()),
        per_class_f1={c: round(float(f), 4) for c, f in zip(classes, per_class, strict=True)},
        accuracy=correct / len(truth),
    )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index]


def time_per_prompt(
    predict: Callable[[DatasetRow], object], rows: Sequence[DatasetRow]
) -> dict[str, float]:
    """Wall time of one call per row (p50, p99, mean) and mean CPU time, in milliseconds.

    CPU time is reported beside wall time because this machine is shared: other
    processes inflate wall time, not the CPU a prediction itself burns.
    """
    for row in rows[:20]:
        predict(row)  # warm caches and lazy imports before timing
    wall, cpu = [], []
    for row in rows:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        predict(row)
        cpu.append((time.process_time() - cpu_start) * 1000.0)
        wall.append((time.perf_counter() - wall_start) * 1000.0)
    wall.sort()
    return {
        "p50_ms": round(_percentile(wall, 0.5), 3),
        "p99_ms": round(_percentile(wall, 0.99), 3),
        "mean_ms": round(sum(wall) / len(wall), 3),
        "cpu_mean_ms": round(sum(cpu) / len(cpu), 3),
    }


def _recipe(rows: Sequence[DatasetRow], seed: int) -> ClassifierRecipe:
    examples = tuple(LabelledPrompt(r.prompt, r.workload_class, r.temperature) for r in rows)
    return ClassifierRecipe(examples, seed)


def score_split(
    train: Sequence[DatasetRow], test: Sequence[DatasetRow], seed: int
) -> tuple[WorkloadClassifier, dict[str, Scores]]:
    """Train on ``train`` and score every predictor on ``test``, side by side."""
    classifier = train_classifier(_recipe(train, seed))
    text_only = train_classifier(_recipe(train, seed), shape_weight=0.0)
    prompts, temperatures = [r.prompt for r in test], [r.temperature for r in test]
    majority = Counter(r.workload_class for r in train).most_common(1)[0][0]
    predictors: dict[str, Sequence[str]] = {
        "model": [p.workload_class for p in classifier.predict_many(prompts, temperatures)],
        # Ablation: the same pipeline without the numeric shape features.
        "model_text_only": [
            p.workload_class for p in text_only.predict_many(prompts, temperatures)
        ],
        "keyword_rules": [keyword_rules(r.prompt) for r in test],
        "majority_class": [majority] * len(test),
    }
    truth = [r.workload_class for r in test]
    return classifier, {
        name: score(truth, predicted, classifier.classes) for name, predicted in predictors.items()
    }


def _ratio(scores: dict[str, Scores], baseline: str) -> float:
    return round(scores["model"].macro_f1 / max(scores[baseline].macro_f1, 1e-9), 3)


def run_benchmark() -> dict[str, Any]:
    """Score the shipped default model and the baselines on its held-out split."""
    rows = load_default_dataset()
    train = [r for r in rows if r.split == "train"]
    test = [r for r in rows if r.split == "test"]
    classifier, scores = score_split(train, test, DEFAULT_SEED)
    if classifier.recipe != default_recipe():
        raise AssertionError("the benchmark must score the shipped model's own recipe")

    start = time.perf_counter()
    train_classifier(default_recipe())
    train_s = time.perf_counter() - start
    model_latency = time_per_prompt(lambda r: classifier.predict(r.prompt, r.temperature), test)
    # The same model through scikit-learn's pipeline, one prompt per call: what predict()
    # cost before it evaluated the fitted model directly.
    pipeline_latency = time_per_prompt(
        lambda r: classifier.probabilities([r.prompt], [r.temperature]), test
    )
    rules_latency = time_per_prompt(lambda r: keyword_rules(r.prompt), test)
    return {
        "benchmark": "classifier",
        "classes": list(classifier.classes),
        "train_prompts": len(train),
        "held_out_prompts": len(test),
        "held_out_groups": len({r.group for r in test}),
        "predictors": {
            name: {
                "macro_f1": round(s.macro_f1, 4),
                "accuracy": round(s.accuracy, 4),
                "per_class_f1": s.per_class_f1,
            }
            for name, s in scores.items()
        },
        "latency_per_prompt": {
            "model": model_latency,
            "model_pipeline": pipeline_latency,
            "keyword_rules": rules_latency,
        },
        "train_seconds": round(train_s, 3),
        "ratios": {
            "macro_f1_vs_keyword_rules": _ratio(scores, "keyword_rules"),
            "macro_f1_vs_text_only": _ratio(scores, "model_text_only"),
            "macro_f1_vs_majority_class": _ratio(scores, "majority_class"),
            "cpu_per_prompt_pipeline_over_model": round(
                pipeline_latency["cpu_mean_ms"] / model_latency["cpu_mean_ms"], 2
            ),
        },
    }


def resplit_benchmark(seeds: Sequence[int], doc_dir: Path) -> dict[str, Any]:
    """Macro-F1 per predictor on datasets rebuilt from this machine's material per seed.

    Each seed holds out different documents and templates, so the spread says how much
    the single shipped split's figure owes to which templates it happened to hold out.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    per_seed: dict[str, list[float]] = {}
    for seed in seeds:
        rows = build_dataset(collect_local_material(stdlib, doc_dir, random.Random(seed)), seed)
        train = [r for r in rows if r.split == "train"]
        test = [r for r in rows if r.split == "test"]
        _, scores = score_split(train, test, seed)
        for name, s in scores.items():
            per_seed.setdefault(name, []).append(round(s.macro_f1, 4))
    return {
        "seeds": list(seeds),
        "macro_f1": {
            name: {
                "mean": round(sum(values) / len(values), 4),
                "min": min(values),
                "per_seed": values,
            }
            for name, values in per_seed.items()
        },
    }


def _print_table(result: dict[str, Any]) -> None:
    classes = result["classes"]
    print(
        f"workload classifier: {result['train_prompts']} train / {result['held_out_prompts']} "
        f"held-out prompts ({result['held_out_groups']} unseen documents/templates)"
    )
    header = f"{'predictor':<16}{'macro-F1':>9}" + "".join(f"{c:>12}" for c in classes)
    print(header)
    for name, s in result["predictors"].items():
        cells = "".join(f"{s['per_class_f1'][c]:>12.3f}" for c in classes)
        print(f"{name:<16}{s['macro_f1']:>9.3f}{cells}")
    for name, lat in result["latency_per_prompt"].items():
        print(
            f"latency {name:<14} p50 {lat['p50_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms  "
            f"(CPU {lat['cpu_mean_ms']:.2f} ms)"
        )
    print(f"training (model file load) {result['train_seconds']:.2f} s")
    for name, spread in result.get("resplits", {}).get("macro_f1", {}).items():
        print(
            f"re-split {name:<16} mean macro-F1 {spread['mean']:.3f}  min {spread['min']:.3f}  "
            f"({len(spread['per_seed'])} dataset seeds)"
        )
    ratios = result["ratios"]
    print(
        f"macro-F1 ratio: {ratios['macro_f1_vs_keyword_rules']:.2f}x keyword rules, "
        f"{ratios['macro_f1_vs_text_only']:.2f}x text-only, "
        f"{ratios['macro_f1_vs_majority_class']:.2f}x majority class"
    )
    print(
        "CPU per prompt: the pipeline takes "
        f"{ratios['cpu_per_prompt_pipeline_over_model']:.1f}x what the model's own path takes"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``python -m bench.classifier`` and ``specpilot bench classifier``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--resplit-seeds",
        type=int,
        default=0,
        metavar="N",
        help="also rebuild the dataset from local material with seeds 0..N-1 and report "
        "macro-F1 across those splits (slow: about 20 s per seed)",
    )
    parser.add_argument("--doc-dir", type=Path, default=Path("/usr/share/doc"))
    parser.set_defaults(func=run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``classifier`` to a ``bench`` sub-command group."""
    add_arguments(subparsers.add_parser("classifier", help="workload classifier F1 and latency"))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print it, write bench/results/classifier.json."""
    result = run_benchmark()
    if args.resplit_seeds > 0:
        result["resplits"] = resplit_benchmark(range(args.resplit_seeds), args.doc_dir)
    RESULT_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULT_PATH.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.classifier", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
