"""Workload classification: which class a request belongs to, so the policy can key its context.

Speculation pays by workload: code, JSON and edit/RAG prompts make the model copy or
follow rigid structure (high acceptance, and n-gram proposers shine where the prompt
repeats itself); chat is in between; creative prose at high temperature is low. The
policy keeps one context per class name, so every request needs a class, cheaply, in
the gateway.

Two ways to get one, in this order:

1. **Explicit** — the client says it: the header ``X-Workload-Class`` (case-insensitive
   name) or the OpenAI body's ``metadata.workload_class``; the header wins over the
   body. Values are normalised (trimmed, lower-cased). Here a value that is not one of
   the model's classes raises :class:`UnknownWorkloadClassError` (``specpilot classify``
   reports it) instead of falling back to a prediction. The gateway reads the header
   and metadata itself (``controller.gateway.classify.RequestKeys``) and puts a class
   the settings do not list in their default class: it serves the request either way,
   and no made-up value becomes a context of the policy.
2. **Model** — a scikit-learn pipeline predicts it from the prompt: hashed TF-IDF of
   character 1–3-grams and words (hashing bounds memory whatever the vocabulary) plus
   numeric "shape" features — prompt length, code and JSON markers, how much the
   prompt repeats itself (share of repeated word 3-grams and lines: what an n-gram
   proposer feeds on) and the sampling temperature — into a linear model with
   logistic loss (one-vs-rest, fitted by SGD), which costs one sparse dot product to
   evaluate and gives probabilities good enough to report and threshold.
   Only the head and tail of long prompts go through the n-gram features
   (:data:`TEXT_CLIP_CHARS`) so the per-request cost is bounded; the numeric features
   still see the whole length.

Why models are stored as *recipes*, not pickles: a pickled scikit-learn estimator is
only guaranteed to load under the exact scikit-learn version that wrote it, and loading
a pickle runs arbitrary code. A :class:`ClassifierRecipe` is plain JSON — the labelled
prompts and the seed — and loading one retrains the pipeline, which is deterministic
(same recipe, same scikit-learn → same predictions) and takes about a second for the
default's 1,120 prompts on this 2-core machine (``bench/classifier.py`` measures it).
The cost is paid once per process: callers keep the trained classifier
(``default_classifier`` does) rather than retrain per request. The default model is
such a recipe, built from local material and committed as package data (see
:mod:`policies.classifier_data`).

One prediction through the scikit-learn pipeline costs about 3 ms of CPU here
(``specpilot bench classifier`` measures both paths), most of it the pipeline's per-call
machinery (input checks, column dispatch, parallel helpers), not the features. The
gateway classifies every request on its event loop, so a trained classifier predicts
with :class:`_LinearScorer` instead: the same fitted vectorizers, IDF weights, scaler
and coefficients applied to one prompt directly, with the same probabilities (tests
compare the two on every training prompt), in well under a millisecond.

This module does no I/O other than reading that package data: it turns strings and
mappings into classes.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from sklearn import config_context
from sklearn.compose import ColumnTransformer
from sklearn.feature_extraction import FeatureHasher
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer
from sklearn.linear_model import SGDClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

# Re-exported: the shipped model's classes are defined where its dataset is built.
from policies.classifier_data.generate import DEFAULT_CLASSES as DEFAULT_CLASSES

WORKLOAD_CLASS_HEADER = "X-Workload-Class"
METADATA_CLASS_FIELD = "workload_class"
"""Key inside the OpenAI body's ``metadata`` object that names the class."""

TEXT_CLIP_CHARS = 2000
"""Characters of a prompt (half from the head, half from the tail) that reach the n-gram
features: instructions sit at the start or the end, and the cost of hashing n-grams
grows with length, so this bounds the per-request latency."""

REPETITION_SCAN_CHARS = 20_000
"""Characters scanned for repeated n-grams and lines; longer prompts are judged on
their head, which keeps that feature linear-time with a fixed ceiling."""

DEFAULT_TEMPERATURE = 1.0
"""What the OpenAI API assumes when a request sets no temperature."""

_CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|return\b|#include|#define|if\s*\(|for\s*\(|"
    r"while\s*\(|function\b|var |let |const |public |private |static |\}|\{|@\w)"
    r"|[;{]\s*$|\)\s*:\s*$|^(\t| {4})"
)
_JSON_KEY = re.compile(r'"[^"\n]{1,40}"\s*:')
_WORD = re.compile(r"\w+")
_CODE_SYMBOLS = frozenset("{}[]();=<>")
_JSON_SYMBOLS = frozenset('{}[]":,')

ClassSource = Literal["explicit", "model"]


class UnknownWorkloadClassError(ValueError):
    """A request named a workload class the model does not know."""


class RequestShapeError(ValueError):
    """A request body's prompt, messages, metadata or temperature has the wrong type."""


class JsonLinesError(ValueError):
    """A line of JSON-lines input is malformed; the message names the source and line."""

    def __init__(self, source: str, line_number: int, problem: str) -> None:
        super().__init__(f"{source}:{line_number}: {problem}")
        self.source = source
        self.line_number = line_number
        self.problem = problem


@dataclass(frozen=True, slots=True)
class LabelledPrompt:
    """One training example: a prompt, its class, and the temperature it was sent with."""

    prompt: str
    workload_class: str
    temperature: float | None = None


@dataclass(frozen=True, slots=True)
class Prediction:
    """The model's guess for one prompt; ``probability`` in [0, 1]."""

    workload_class: str
    probability: float


@dataclass(frozen=True, slots=True)
class Classification:
    """The class a request is served under and where it came from.

    ``probability`` is 1.0 for an explicit class and the model's probability otherwise.
    """

    workload_class: str
    source: ClassSource
    probability: float


@dataclass(frozen=True, slots=True)
class ClassifierRecipe:
    """Everything needed to rebuild a classifier deterministically: the model file format."""

    examples: tuple[LabelledPrompt, ...]
    seed: int = 0


RECIPE_FORMAT = "specpilot-workload-classifier"
RECIPE_VERSION = 1


def normalise_class_name(name: str) -> str:
    """Trim and lower-case a class name; class names are context keys and metric labels."""
    return name.strip().lower()


def validate_class_name(name: str) -> str:
    """Return the normalised name, or raise ValueError if it cannot be a label value."""
    normal = normalise_class_name(name)
    if not _CLASS_NAME.match(normal):
        raise ValueError(
            f"workload class {name!r} must be 1-64 characters of a-z, 0-9, '_', '.', '-' "
            "starting with a letter or digit"
        )
    return normal


# --- features ---------------------------------------------------------------------


def clip_text(text: str) -> str:
    """Head and tail of ``text``, at most :data:`TEXT_CLIP_CHARS` characters in all."""
    if len(text) <= TEXT_CLIP_CHARS:
        return text
    half = TEXT_CLIP_CHARS // 2
    return text[:half] + "\n" + text[-half:]


def _clip_column(texts: npt.NDArray[Any]) -> list[str]:
    return [clip_text(str(t)) for t in texts]


def repeated_ngram_share(text: str, n: int = 3) -> float:
    """Share of word n-grams in ``text`` that occur more than once, in [0, 1].

    It measures what an n-gram (prompt-lookup) proposer can copy from: a prompt that
    repeats itself lets it guess the continuation.
    """
    words = _WORD.findall(text[:REPETITION_SCAN_CHARS].lower())
    if len(words) < n:
        return 0.0
    counts = Counter(zip(*(words[i:] for i in range(n)), strict=False))  # shifted copies
    repeated = sum(c for c in counts.values() if c > 1)
    return repeated / (len(words) - n + 1)


def _repeated_line_share(lines: Sequence[str]) -> float:
    seen: set[str] = set()
    repeats = 0
    for line in lines:
        if line in seen:
            repeats += 1
        seen.add(line)
    return repeats / len(lines) if lines else 0.0


SHAPE_FEATURES: tuple[str, ...] = (
    "log_chars",
    "log_lines",
    "code_line_share",
    "code_symbol_share",
    "json_symbol_share",
    "json_keys_per_line",
    "letter_share",
    "repeated_trigram_share",
    "repeated_line_share",
    "temperature",
)
"""Names of the numeric features, in column order."""


def shape_features(text: str, temperature: float | None) -> list[float]:
    """The numeric features of one prompt, in :data:`SHAPE_FEATURES` order."""
    scanned = text[:REPETITION_SCAN_CHARS]
    lines = [line for line in scanned.splitlines() if line.strip()]
    n_chars = max(len(scanned), 1)
    code_lines = sum(1 for line in lines if _CODE_LINE.search(line))
    # Counted in C (str.count per symbol, map over characters): a Python loop over
    # every character was most of a long prompt's classification time.
    code_symbols = sum(map(scanned.count, _CODE_SYMBOLS))
    json_symbols = sum(map(scanned.count, _JSON_SYMBOLS))
    letters = sum(map(str.isalpha, scanned))
    return [
        math.log1p(len(text)),
        math.log1p(text.count("\n") + 1),
        code_lines / len(lines) if lines else 0.0,
        code_symbols / n_chars,
        json_symbols / n_chars,
        len(_JSON_KEY.findall(scanned)) / max(len(lines), 1),
        letters / n_chars,
        repeated_ngram_share(scanned),
        _repeated_line_share([line.strip() for line in lines]),
        DEFAULT_TEMPERATURE if temperature is None or math.isnan(temperature) else temperature,
    ]


def _shape_matrix(rows: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    return np.array(
        [shape_features(str(text), _as_temperature(temp)) for text, temp in rows],
        dtype=np.float64,
    ).reshape(len(rows), len(SHAPE_FEATURES))


def _as_temperature(value: object) -> float | None:
    if value is None:
        return None
    return float(value)  # type: ignore[arg-type]


HASHED_FEATURES = 2**16
"""Columns per hashed n-gram family: fixed memory whatever the vocabulary."""


def _hashed_tfidf(
    analyzer: str, ngram_range: tuple[int, int], token_pattern: str | None = None
) -> Pipeline:
    """Clip the text, hash its n-grams, weight them by TF-IDF."""
    vectorizer = HashingVectorizer(
        analyzer=analyzer,
        ngram_range=ngram_range,
        token_pattern=token_pattern,
        n_features=HASHED_FEATURES,
        alternate_sign=False,
        norm=None,
        lowercase=True,
    )
    return Pipeline(
        [
            ("clip", FunctionTransformer(_clip_column)),
            ("hash", vectorizer),
            ("tfidf", TfidfTransformer(sublinear_tf=True)),
        ]
    )


# Punctuation is a token of its own: braces, colons and quotes mark code and JSON.
_WORD_TOKENS = r"(?u)\b\w+\b|[{}\[\]();:=<>#\"'`]"


SHAPE_FEATURE_WEIGHT = 0.25
"""Weight of the standardised shape features beside the two unit-norm TF-IDF blocks.

At full weight their few dense columns crowd out the text (mean held-out macro-F1 over
four dataset seeds 0.895); at 0 they are missing (0.891); at 0.1-0.25 they add what
the text misses (0.915). Chosen with the n-gram ranges on those four seeds."""


def build_pipeline(seed: int, shape_weight: float = SHAPE_FEATURE_WEIGHT) -> Pipeline:
    """The untrained pipeline; input rows are ``[prompt_text, temperature_or_nan]``.

    ``shape_weight`` scales the numeric features (0 leaves them out: an ablation).
    """
    features = ColumnTransformer(
        [
            # Character 1-3-grams and single words: longer n-grams scored lower on the
            # held-out splits of four dataset seeds, and cost more per request.
            ("chars", _hashed_tfidf("char_wb", (1, 3)), 0),
            ("words", _hashed_tfidf("word", (1, 1), _WORD_TOKENS), 0),
            (
                "shape",
                Pipeline(
                    [("measure", FunctionTransformer(_shape_matrix)), ("scale", StandardScaler())]
                ),
                [0, 1],
            ),
        ],
        transformer_weights={"chars": 1.0, "words": 1.0, "shape": shape_weight},
    )
    # Logistic loss fitted by SGD: the same model as LogisticRegression (probabilities
    # included) but trained in about a second on 2^17 hashed columns, where lbfgs took
    # over ten. Fixed epochs (tol=None) and a seeded shuffle keep it deterministic.
    model = SGDClassifier(loss="log_loss", alpha=1e-4, max_iter=30, tol=None, random_state=seed)
    return Pipeline([("features", features), ("model", model)])


def _rows(prompts: Sequence[str], temperatures: Sequence[float | None]) -> npt.NDArray[Any]:
    rows = np.empty((len(prompts), 2), dtype=object)
    for i, (prompt, temperature) in enumerate(zip(prompts, temperatures, strict=True)):
        rows[i, 0] = prompt
        rows[i, 1] = math.nan if temperature is None else float(temperature)
    return rows


# --- the classifier ---------------------------------------------------------------


class _LinearScorer:
    """The fitted pipeline of :func:`build_pipeline`, evaluated for one prompt without
    scikit-learn's per-call machinery: the same arithmetic as ``predict_proba``.

    Per text block: the fitted vectorizer's analyzer and a hasher with its settings give
    n-gram counts, then TF-IDF as the fitted transformer does it (sublinear tf, idf, L2
    norm). Each block's scores are a dot product with its slice of ``coef_`` (scaled by
    the block's transformer weight); the shape features are scaled as the fitted scaler
    does. Probabilities as SGDClassifier's ``predict_proba`` for log loss: the logistic
    of each class's score, normalised over classes (one-vs-rest).
    """

    def __init__(self, pipeline: Pipeline) -> None:
        features: ColumnTransformer = pipeline.named_steps["features"]
        model: SGDClassifier = pipeline.named_steps["model"]
        weights = features.transformer_weights or {}
        coef = np.asarray(model.coef_, dtype=np.float64)
        self._intercept = np.asarray(model.intercept_, dtype=np.float64)
        self._blocks: list[tuple[Any, FeatureHasher, npt.NDArray[np.float64], Any]] = []
        at = 0
        for name in ("chars", "words"):
            steps = features.named_transformers_[name].named_steps
            vectorizer: HashingVectorizer = steps["hash"]
            tfidf: TfidfTransformer = steps["tfidf"]
            width = int(vectorizer.n_features)
            hasher = FeatureHasher(
                n_features=width, input_type="string", alternate_sign=vectorizer.alternate_sign
            )
            block = coef[:, at : at + width] * weights.get(name, 1.0)
            # (width, classes), C order: one row gather per n-gram present.
            self._blocks.append(
                (vectorizer.build_analyzer(), hasher, np.ascontiguousarray(block.T), tfidf)
            )
            at += width
        scaler: StandardScaler = features.named_transformers_["shape"].named_steps["scale"]
        self._shape_mean = np.asarray(scaler.mean_, dtype=np.float64)
        self._shape_scale = np.asarray(scaler.scale_, dtype=np.float64)
        self._shape_coef = coef[:, at:].T * weights.get("shape", 1.0)
        if at + len(SHAPE_FEATURES) != coef.shape[1]:
            raise ValueError("the pipeline's columns are not chars, words and shape features")

    def probabilities(self, prompt: str, temperature: float | None) -> npt.NDArray[np.float64]:
        scores = self._intercept.copy()
        clipped = clip_text(prompt)
        # One hashing call per block; validation off, as in WorkloadClassifier.probabilities.
        with config_context(assume_finite=True, skip_parameter_validation=True):
            hashed = [
                hasher.transform([analyzer(clipped)]) for analyzer, hasher, _, _ in self._blocks
            ]
        for counts, (_, _, block, tfidf) in zip(hashed, self._blocks, strict=True):
            if counts.nnz == 0:
                continue
            columns = counts.indices
            values = counts.data.astype(np.float64)
            if tfidf.sublinear_tf:
                values = np.log(values) + 1.0
            if tfidf.use_idf:
                values *= tfidf.idf_[columns]
            if tfidf.norm == "l2":
                values /= math.sqrt(float(values @ values))
            elif tfidf.norm == "l1":
                values /= float(np.abs(values).sum())
            scores += values @ block[columns]
        shape = np.asarray(shape_features(prompt, temperature), dtype=np.float64)
        scores += ((shape - self._shape_mean) / self._shape_scale) @ self._shape_coef
        if len(scores) == 1:  # two classes: one score, for the second class
            positive = 1.0 / (1.0 + math.exp(-float(scores[0])))
            return np.array([1.0 - positive, positive])
        probabilities = 1.0 / (1.0 + np.exp(-scores))
        total = float(probabilities.sum())
        if total == 0.0:
            return np.full(len(probabilities), 1.0 / len(probabilities))
        return probabilities / total


class WorkloadClassifier:
    """A trained pipeline and the recipe it came from. Build with :func:`train_classifier`."""

    def __init__(self, pipeline: Pipeline, recipe: ClassifierRecipe) -> None:
        self._pipeline = pipeline
        self._scorer = _LinearScorer(pipeline)
        self.recipe = recipe
        self.classes: tuple[str, ...] = tuple(str(c) for c in pipeline.classes_)
        """The class names this model can return (and accepts as explicit classes)."""

    def predict(self, prompt: str, temperature: float | None = None) -> Prediction:
        """The most probable class of one prompt (the fast path: :class:`_LinearScorer`)."""
        probabilities = self._scorer.probabilities(prompt, temperature)
        best = int(probabilities.argmax())
        return Prediction(self.classes[best], float(probabilities[best]))

    def predict_many(
        self, prompts: Sequence[str], temperatures: Sequence[float | None] | None = None
    ) -> list[Prediction]:
        """Batch form of :meth:`predict`; ``temperatures`` defaults to all unset."""
        if not prompts:
            return []
        temps = list(temperatures) if temperatures is not None else [None] * len(prompts)
        probabilities = self.probabilities(prompts, temps)
        best = probabilities.argmax(axis=1)
        return [
            Prediction(self.classes[int(i)], float(probabilities[row, int(i)]))
            for row, i in enumerate(best)
        ]

    def probabilities(
        self, prompts: Sequence[str], temperatures: Sequence[float | None]
    ) -> npt.NDArray[np.float64]:
        """Probability of each class (columns in :attr:`classes` order) per prompt."""
        # The rows are built here, so sklearn's per-call validation is pure overhead,
        # and it is a large part of the latency of a one-prompt prediction.
        with config_context(assume_finite=True, skip_parameter_validation=True):
            result: npt.NDArray[np.float64] = self._pipeline.predict_proba(
                _rows(prompts, temperatures)
            )
        return result

    def classify_request(
        self, headers: Mapping[str, str], body: Mapping[str, Any]
    ) -> Classification:
        """The class to serve a request under: explicit if the request names one, else
        predicted. Raises :class:`UnknownWorkloadClassError` for an unknown explicit class
        and :class:`RequestShapeError` for a malformed body."""
        explicit = explicit_class(headers, body)
        if explicit is not None:
            name, where = explicit
            if name not in self.classes:
                raise UnknownWorkloadClassError(
                    f"workload class {name!r} from {where} is not one of this model's classes: "
                    + ", ".join(self.classes)
                )
            return Classification(name, "explicit", 1.0)
        prediction = self.predict(prompt_text(body), request_temperature(body))
        return Classification(prediction.workload_class, "model", prediction.probability)


def train_classifier(
    recipe: ClassifierRecipe, *, shape_weight: float = SHAPE_FEATURE_WEIGHT
) -> WorkloadClassifier:
    """Fit the pipeline on the recipe's examples. Deterministic for a given recipe.

    ``shape_weight`` is for ablations (see :data:`SHAPE_FEATURE_WEIGHT`). Raises
    ValueError when there are fewer than two classes or a class name is invalid.
    """
    if not recipe.examples:
        raise ValueError("no labelled prompts to train on")
    labels = [validate_class_name(e.workload_class) for e in recipe.examples]
    if len(set(labels)) < 2:
        raise ValueError(f"need at least two classes to train, got only {sorted(set(labels))}")
    pipeline = build_pipeline(recipe.seed, shape_weight)
    rows = _rows([e.prompt for e in recipe.examples], [e.temperature for e in recipe.examples])
    pipeline.fit(rows, np.array(labels, dtype=object))
    model = pipeline.named_steps["model"]
    # Prediction multiplies sparse features by coef_.T; scipy copies that operand when
    # it is not C-contiguous (megabytes per call with 2^17 columns), so store coef_ in
    # Fortran order, whose transpose is C-contiguous. Same numbers, same predictions.
    model.coef_ = np.asfortranarray(model.coef_)
    return WorkloadClassifier(pipeline, recipe)


# --- requests ---------------------------------------------------------------------


def explicit_class(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The normalised class a request names and where (header or metadata), or None.

    The header wins over ``metadata.workload_class``. Empty values count as absent.
    """
    wanted = WORKLOAD_CLASS_HEADER.lower()
    for key, header_value in headers.items():
        if key.lower() == wanted and header_value.strip():
            return normalise_class_name(header_value), f"header {WORKLOAD_CLASS_HEADER}"
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise RequestShapeError("'metadata' must be an object")
    value = metadata.get(METADATA_CLASS_FIELD)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestShapeError(f"'metadata.{METADATA_CLASS_FIELD}' must be a string")
    if not value.strip():
        return None
    return normalise_class_name(value), f"metadata.{METADATA_CLASS_FIELD}"


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text of a completions ``prompt`` or chat ``messages``, as the model sees it.

    A list of prompts is joined with newlines; chat messages' text contents (plain
    strings or ``{"type": "text"}`` parts) are joined with blank lines. Token-id
    prompts carry no text and give "" (the shape features still apply).
    """
    if "messages" in body and body["messages"] is not None:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise RequestShapeError("'messages' must be a list")
        return "\n\n".join(_message_text(m, i) for i, m in enumerate(messages))
    prompt = body.get("prompt")
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(p, int | list) for p in prompt):
            return ""
    raise RequestShapeError("'prompt' must be a string, a list of strings or token ids")


def _message_text(message: object, index: int) -> str:
    if not isinstance(message, Mapping):
        raise RequestShapeError(f"'messages[{index}]' must be an object")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return "\n".join(parts)
    raise RequestShapeError(f"'messages[{index}].content' must be a string or a list of parts")


def request_temperature(body: Mapping[str, Any]) -> float | None:
    """The body's sampling temperature, or None if unset."""
    value = body.get("temperature")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestShapeError("'temperature' must be a finite number")
    if value < 0:
        raise RequestShapeError("'temperature' must not be negative")
    return float(value)


# --- recipes and labelled data ------------------------------------------------------


def json_object_lines(lines: Iterable[str], source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The JSON objects of a JSON-lines text with their 1-based line numbers.

    Blank lines are skipped; anything else that is not a JSON object raises
    :class:`JsonLinesError` naming the line.
    """
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise JsonLinesError(source, number, f"not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise JsonLinesError(source, number, "expected a JSON object")
        yield number, record


def parse_labelled_lines(lines: Iterable[str], source: str = "<input>") -> list[LabelledPrompt]:
    """Parse JSON lines ``{"prompt": str, "class": str, "temperature"?: number}``.

    Raises :class:`JsonLinesError` naming the 1-based line of the first bad one.
    """
    examples = [
        _labelled_from_record(record, source, number)
        for number, record in json_object_lines(lines, source)
    ]
    if not examples:
        raise JsonLinesError(source, 0, "no labelled prompts found")
    return examples


def _labelled_from_record(record: Mapping[str, Any], source: str, number: int) -> LabelledPrompt:
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        raise JsonLinesError(source, number, "'prompt' must be a string")
    label = record.get("class")
    if not isinstance(label, str):
        raise JsonLinesError(source, number, "'class' must be a string")
    try:
        name = validate_class_name(label)
        temperature = request_temperature(record)
    except ValueError as exc:
        raise JsonLinesError(source, number, str(exc)) from None
    return LabelledPrompt(prompt, name, temperature)


def dumps_recipe(recipe: ClassifierRecipe) -> str:
    """The recipe as JSON text (the model file format)."""
    return json.dumps(
        {
            "format": RECIPE_FORMAT,
            "version": RECIPE_VERSION,
            "seed": recipe.seed,
            "classes": sorted({e.workload_class for e in recipe.examples}),
            "examples": [
                {"prompt": e.prompt, "class": e.workload_class, "temperature": e.temperature}
                for e in recipe.examples
            ],
        },
        ensure_ascii=False,
    )


def loads_recipe(text: str, source: str = "<model>") -> ClassifierRecipe:
    """Parse :func:`dumps_recipe` output; raises ValueError naming what is wrong."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not a classifier model file ({exc.msg})") from None
    if not isinstance(document, dict) or document.get("format") != RECIPE_FORMAT:
        raise ValueError(f"{source}: not a classifier model file (format is not {RECIPE_FORMAT})")
    if document.get("version") != RECIPE_VERSION:
        raise ValueError(f"{source}: unsupported model file version {document.get('version')!r}")
    seed = document.get("seed")
    records = document.get("examples")
    if not isinstance(seed, int) or not isinstance(records, list):
        raise ValueError(f"{source}: 'seed' must be an integer and 'examples' a list")
    examples = []
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise JsonLinesError(source, index + 1, "example must be an object")
        examples.append(_labelled_from_record(record, f"{source} example", index + 1))
    return ClassifierRecipe(tuple(examples), seed)


# --- the shipped default ----------------------------------------------------------


def default_recipe() -> ClassifierRecipe:
    """The shipped model's recipe: the *train* split of the committed default dataset.

    The held-out split stays out so that the benchmark's F1 is that of this very model.
    """
    # Imported here: the dataset is package data that only the default path needs.
    from policies.classifier_data import DEFAULT_SEED, load_default_dataset

    examples = tuple(
        LabelledPrompt(row.prompt, row.workload_class, row.temperature)
        for row in load_default_dataset()
        if row.split == "train"
    )
    return ClassifierRecipe(examples, DEFAULT_SEED)


@cache
def default_classifier() -> WorkloadClassifier:
    """The shipped model, trained once per process on first use (about a second)."""
    return train_classifier(default_recipe())
