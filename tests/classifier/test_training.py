"""Training is deterministic, recipes round-trip, bad labelled data names its line."""

from __future__ import annotations

import numpy as np
import pytest

from policies.classifier import (
    SHAPE_FEATURES,
    ClassifierRecipe,
    JsonLinesError,
    LabelledPrompt,
    WorkloadClassifier,
    default_classifier,
    dumps_recipe,
    loads_recipe,
    parse_labelled_lines,
    repeated_ngram_share,
    shape_features,
    train_classifier,
)
from tests.classifier.conftest import SMALL_EXAMPLES

PROBES = [
    "while True:\n    x += 1\n",
    '{"id": 1, "tags": []}',
    "Write a song about snow.",
    "hello there",
]


def test_same_recipe_gives_identical_predictions(
    small_classifier: WorkloadClassifier, small_recipe: ClassifierRecipe
) -> None:
    # A fresh recipe object with equal content: nothing cached may be shared.
    again = train_classifier(ClassifierRecipe(tuple(small_recipe.examples), small_recipe.seed))
    temps: list[float | None] = [None, 0.0, 1.0, 0.5]
    assert np.array_equal(
        small_classifier.probabilities(PROBES, temps), again.probabilities(PROBES, temps)
    )


def test_recipe_json_round_trip_rebuilds_the_same_model(
    small_classifier: WorkloadClassifier,
) -> None:
    text = dumps_recipe(small_classifier.recipe)
    recipe = loads_recipe(text)
    assert recipe == small_classifier.recipe
    rebuilt = train_classifier(recipe)
    assert rebuilt.classes == small_classifier.classes == ("code", "creative", "structured")
    assert [p.workload_class for p in rebuilt.predict_many(PROBES)] == [
        p.workload_class for p in small_classifier.predict_many(PROBES)
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "format"),
        ('{"format": "specpilot-workload-classifier", "version": 99}', "version 99"),
        ("not json", "not a classifier model file"),
    ],
)
def test_bad_model_files_are_rejected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loads_recipe(text, "m.json")


def test_training_needs_two_valid_classes() -> None:
    with pytest.raises(ValueError, match="at least two classes"):
        train_classifier(ClassifierRecipe((LabelledPrompt("a", "x"), LabelledPrompt("b", "x"))))
    with pytest.raises(ValueError, match="must be 1-64 characters"):
        train_classifier(
            ClassifierRecipe((LabelledPrompt("a", "has space"), LabelledPrompt("b", "y")))
        )


def test_labelled_lines_parse_and_normalise() -> None:
    lines = [
        '{"prompt": "def f(): pass", "class": "Code", "temperature": 0.2}',
        "",
        '{"prompt": "a poem", "class": "creative"}',
    ]
    assert parse_labelled_lines(lines) == [
        LabelledPrompt("def f(): pass", "code", 0.2),
        LabelledPrompt("a poem", "creative", None),
    ]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('["prompt", "class"]', "expected a JSON object"),
        ('{"prompt": 3, "class": "code"}', "'prompt' must be a string"),
        ('{"prompt": "x"}', "'class' must be a string"),
        ('{"prompt": "x", "class": "a/b"}', "must be 1-64 characters"),
        ('{"prompt": "x", "class": "code", "temperature": -1}', "must not be negative"),
    ],
)
def test_bad_labelled_line_names_its_number(bad_line: str, problem: str) -> None:
    lines = ['{"prompt": "ok", "class": "code"}', "", bad_line]
    with pytest.raises(JsonLinesError) as info:
        parse_labelled_lines(lines, "data.jsonl")
    assert info.value.line_number == 3
    assert str(info.value).startswith("data.jsonl:3: ")
    assert problem in str(info.value)


def test_repetition_feature_measures_repeated_trigrams() -> None:
    assert repeated_ngram_share("one two three four five") == 0.0
    # "a b c" twice among 4 trigrams ("a b c", "b c a", "c a b", "a b c").
    assert repeated_ngram_share("a b c a b c") == pytest.approx(0.5)
    assert repeated_ngram_share("x y") == 0.0


def test_shape_features_see_code_json_and_temperature() -> None:
    names = list(SHAPE_FEATURES)
    code = dict(zip(names, shape_features("def f(x):\n    return x;\n", None), strict=True))
    prose = dict(zip(names, shape_features("A calm and quiet evening.", 0.9), strict=True))
    data = dict(zip(names, shape_features('{"a": 1,\n "b": 2}', 0.0), strict=True))
    assert code["code_line_share"] > prose["code_line_share"]
    assert data["json_keys_per_line"] > code["json_keys_per_line"]
    assert code["temperature"] == 1.0  # unset means the API default
    assert prose["temperature"] == 0.9


def _pipeline_probabilities(
    classifier: WorkloadClassifier, prompts: list[str], temperatures: list[float | None]
) -> np.ndarray:  # type: ignore[type-arg]
    return classifier.probabilities(prompts, temperatures)  # scikit-learn's predict_proba


def test_fast_prediction_is_the_pipelines_arithmetic_on_every_training_prompt() -> None:
    # The default model (five classes) and a two-class one (sklearn's binary branch).
    two = train_classifier(
        ClassifierRecipe(
            tuple(e for e in SMALL_EXAMPLES if e.workload_class in {"code", "creative"}), seed=1
        )
    )
    for classifier in (default_classifier(), two):
        examples = classifier.recipe.examples
        prompts = [e.prompt for e in examples] + ["", "   ", "{}" * 3000, "héllo wörld " * 50]
        temperatures = [e.temperature for e in examples] + [None, 0.0, 1.5, None]
        expected = _pipeline_probabilities(classifier, prompts, temperatures)
        for row, (prompt, temperature) in enumerate(zip(prompts, temperatures, strict=True)):
            prediction = classifier.predict(prompt, temperature)
            best = int(expected[row].argmax())
            assert prediction.workload_class == classifier.classes[best], prompt[:60]
            assert prediction.probability == pytest.approx(expected[row, best], abs=1e-9)
