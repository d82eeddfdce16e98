"""``specpilot classify``: predict, retrain and rebuild the workload classifier.

- ``specpilot classify [--model MODEL] < requests.jsonl`` prints one JSON line per input
  line: ``{"line", "class", "probability", "source"}`` (plus ``id`` when the input has
  one). An input line is a request body: ``{"prompt": ...}`` or ``{"messages": [...]}``,
  optionally ``temperature`` and ``metadata.workload_class`` (which wins, as in the
  gateway).
- ``specpilot classify train --data labelled.jsonl --out MODEL`` trains on lines
  ``{"prompt": str, "class": str, "temperature"?: number}`` and writes the model file
  (a JSON recipe, see :mod:`policies.classifier`). Any class names work.
- ``specpilot classify classes [--model MODEL]`` lists a model's classes.
- ``specpilot classify build-dataset --out FILE`` rebuilds the default labelled set from
  local material (Python's standard library, /usr/share/doc).

This is the command line's I/O shell; the classifier itself stays pure.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

from policies.classifier import (
    ClassifierRecipe,
    JsonLinesError,
    RequestShapeError,
    UnknownWorkloadClassError,
    WorkloadClassifier,
    default_classifier,
    dumps_recipe,
    explicit_class,
    json_object_lines,
    loads_recipe,
    parse_labelled_lines,
    prompt_text,
    request_temperature,
    train_classifier,
)
from policies.classifier_data import DEFAULT_SEED
from policies.classifier_data.generate import (
    ROWS_PER_CLASS,
    SourceDocument,
    build_dataset,
    row_to_json,
)

EXIT_USAGE = 2

_CODE_SUFFIXES = {
    ".c": "c",
    ".h": "c",
    ".awk": "awk",
    ".sh": "shell",
    ".pl": "perl",
    ".py": "python",
    ".js": "javascript",
    ".rb": "ruby",
}
_PROSE_SUFFIXES = {".md", ".txt", ".rst"}
_MAX_DOCUMENT_BYTES = 300_000
_STDLIB_CODE_FILES = 160
_PROSE_PER_PACKAGE = 3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``classify`` and its sub-commands."""
    parser = subparsers.add_parser(
        "classify",
        help="predict, train or rebuild the workload classifier",
        description="Read request bodies as JSON lines on stdin (or --input) and print the "
        "predicted workload class of each, one JSON line per input.",
    )
    parser.add_argument("--model", type=Path, help="model file from `classify train`")
    parser.add_argument("--input", type=Path, help="JSON-lines file to read instead of stdin")
    parser.set_defaults(func=_run_predict)
    commands = parser.add_subparsers(dest="classify_command", metavar="SUBCOMMAND")

    train = commands.add_parser("train", help="train a model from labelled prompts")
    train.add_argument("--data", type=Path, required=True, help="labelled JSON lines")
    train.add_argument("--out", type=Path, required=True, help="model file to write")
    train.add_argument("--seed", type=int, default=DEFAULT_SEED)
    train.set_defaults(func=_run_train)

    classes = commands.add_parser("classes", help="list a model's classes")
    classes.add_argument("--model", type=Path, dest="classes_model")
    classes.set_defaults(func=_run_classes)

    build = commands.add_parser(
        "build-dataset", help="rebuild the default labelled prompts from local material"
    )
    build.add_argument("--out", type=Path, required=True, help="output .jsonl or .jsonl.gz")
    build.add_argument("--seed", type=int, default=DEFAULT_SEED)
    build.add_argument("--doc-dir", type=Path, default=Path("/usr/share/doc"))
    build.add_argument("--rows-per-class", type=int, default=ROWS_PER_CLASS)
    build.set_defaults(func=_run_build_dataset)


def _fail(message: str) -> int:
    print(f"specpilot classify: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def load_model(path: Path | None) -> WorkloadClassifier:
    """The classifier in a model file, or the shipped default when ``path`` is None."""
    if path is None:
        return default_classifier()
    return train_classifier(loads_recipe(path.read_text(encoding="utf-8"), str(path)))


def _run_predict(args: argparse.Namespace) -> int:
    source = str(args.input) if args.input else "<stdin>"
    try:
        text = args.input.read_text(encoding="utf-8") if args.input else sys.stdin.read()
        classifier = load_model(args.model)
        results = classify_lines(classifier, text.splitlines(), source)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    for result in results:
        print(json.dumps(result, ensure_ascii=False))
    return 0


def classify_lines(
    classifier: WorkloadClassifier, lines: list[str], source: str
) -> list[dict[str, Any]]:
    """One result object per non-blank line; raises JsonLinesError naming the bad line.

    Every line is validated before any prediction, so a bad line yields no partial output.
    """
    parsed = list(json_object_lines(lines, source))
    for number, body in parsed:
        if "prompt" not in body and "messages" not in body:
            raise JsonLinesError(source, number, "needs 'prompt' or 'messages'")
    results: list[dict[str, Any]] = []
    predict: list[tuple[dict[str, Any], str, float | None]] = []
    for number, body in parsed:
        result: dict[str, Any] = {"line": number}
        if "id" in body:
            result["id"] = body["id"]
        try:
            if explicit_class({}, body) is not None:
                classification = classifier.classify_request({}, body)
                result.update(
                    {
                        "class": classification.workload_class,
                        "probability": classification.probability,
                        "source": classification.source,
                    }
                )
            else:
                predict.append((result, prompt_text(body), request_temperature(body)))
        except (RequestShapeError, UnknownWorkloadClassError) as exc:
            raise JsonLinesError(source, number, str(exc)) from None
        results.append(result)
    predictions = classifier.predict_many([p for _, p, _ in predict], [t for _, _, t in predict])
    for (result, _, _), prediction in zip(predict, predictions, strict=True):
        result.update(
            {
                "class": prediction.workload_class,
                "probability": round(prediction.probability, 4),
                "source": "model",
            }
        )
    return results


def _run_train(args: argparse.Namespace) -> int:
    try:
        lines = args.data.read_text(encoding="utf-8").splitlines()
        examples = parse_labelled_lines(lines, str(args.data))
        recipe = ClassifierRecipe(tuple(examples), args.seed)
        classifier = train_classifier(recipe)
    except JsonLinesError as exc:
        return _fail(str(exc))
    except (OSError, ValueError) as exc:
        return _fail(f"{args.data}: {exc}")
    try:
        args.out.write_text(dumps_recipe(recipe), encoding="utf-8")
    except OSError as exc:
        return _fail(str(exc))
    counts = Counter(e.workload_class for e in examples)
    summary = ", ".join(f"{name}={counts[name]}" for name in classifier.classes)
    print(f"trained on {len(examples)} prompts ({summary}); wrote {args.out}")
    return 0


def _run_classes(args: argparse.Namespace) -> int:
    try:
        classifier = load_model(args.classes_model or args.model)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    for name in classifier.classes:
        print(name)
    return 0


def _run_build_dataset(args: argparse.Namespace) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = collect_local_material(stdlib, args.doc_dir, random.Random(args.seed))
    try:
        rows = build_dataset(documents, seed=args.seed, rows_per_class=args.rows_per_class)
    except ValueError as exc:
        return _fail(str(exc))
    payload = "".join(row_to_json(row) + "\n" for row in rows).encode("utf-8")
    if args.out.suffix == ".gz":
        # mtime=0 so that the same rows give byte-identical files.
        payload = gzip.compress(payload, compresslevel=9, mtime=0)
    args.out.write_bytes(payload)
    counts = Counter((row.workload_class, row.split) for row in rows)
    print(
        f"{len(documents)} local documents → {len(rows)} rows; "
        + ", ".join(f"{c}/{s}={n}" for (c, s), n in sorted(counts.items()))
        + f"; wrote {args.out}"
    )
    return 0


def collect_local_material(
    stdlib_dir: Path, doc_dir: Path, rng: random.Random
) -> list[SourceDocument]:
    """Code and prose documents from the standard library and a documentation tree.

    Deterministic for the same files and RNG state (paths are sorted before sampling).
    Unreadable or binary files are skipped.
    """
    documents: list[SourceDocument] = []
    modules = sorted(
        p
        for p in stdlib_dir.rglob("*.py")
        if not {"test", "tests", "site-packages", "idle_test"} & set(p.parts)
        # Generated build-configuration tables, not code anyone writes.
        and not p.name.startswith("_sysconfigdata")
    )
    for path in rng.sample(modules, k=min(_STDLIB_CODE_FILES, len(modules))):
        text = _read_text(path)
        if text is None:
            continue
        name = path.relative_to(stdlib_dir).as_posix()
        documents.append(SourceDocument(f"stdlib:{name}", text, "code", "python"))
        docstring = _module_docstring(text)
        if docstring and len(docstring) > 400:
            documents.append(SourceDocument(f"stdlib-doc:{name}", docstring, "prose", "text"))
    per_package: Counter[str] = Counter()
    for path in sorted(p for p in doc_dir.rglob("*") if p.is_file()) if doc_dir.is_dir() else []:
        package = path.relative_to(doc_dir).parts[0]
        name = f"doc:{path.relative_to(doc_dir).as_posix()}"
        suffix = path.suffix.lower()
        if suffix in _CODE_SUFFIXES:
            kind, language = "code", _CODE_SUFFIXES[suffix]
        elif suffix in _PROSE_SUFFIXES or (path.name.startswith("README") and suffix != ".gz"):
            if per_package[package] >= _PROSE_PER_PACKAGE:
                continue
            kind, language = "prose", "text"
        else:
            continue
        text = _read_text(path)
        if text is None:
            continue
        if kind == "prose":
            per_package[package] += 1
            documents.append(SourceDocument(name, text, "prose", language))
        else:
            documents.append(SourceDocument(name, text, "code", language))
    return documents


def _read_text(path: Path) -> str | None:
    try:
        if not 1000 <= path.stat().st_size <= _MAX_DOCUMENT_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _module_docstring(source: str) -> str | None:
    try:
        return ast.get_docstring(ast.parse(source))
    except (SyntaxError, ValueError):
        return None
