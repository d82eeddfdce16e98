"""A small classifier trained on hand-written prompts, shared by the classifier tests."""

from __future__ import annotations

import pytest

from policies.classifier import (
    ClassifierRecipe,
    LabelledPrompt,
    WorkloadClassifier,
    train_classifier,
)

SMALL_EXAMPLES: tuple[LabelledPrompt, ...] = (
    LabelledPrompt("def add(a, b):\n    return a + b\n", "code", 0.0),
    LabelledPrompt("Fix this function:\nfor (i = 0; i < n; i++) {\n  sum += i;\n}", "code", 0.2),
    LabelledPrompt("import os\n\ndef main():\n    print(os.getcwd())\n", "code", None),
    LabelledPrompt("class Stack:\n    def push(self, x):\n        self.items.append(x)", "code"),
    LabelledPrompt(
        'Return JSON with keys "name" and "age": {"name": null, "age": null}', "structured"
    ),
    LabelledPrompt(
        'Convert to JSON:\nname: Ada\nyear: 1843\n{"name": "", "year": 0}', "structured"
    ),
    LabelledPrompt('Output only a JSON object {"label": ..., "score": ...}', "structured", 0.0),
    LabelledPrompt('Fill this template: {"city": null, "country": null}', "structured"),
    LabelledPrompt("Write a poem about the autumn moon and falling leaves.", "creative", 1.0),
    LabelledPrompt("Tell me a story about a dragon who loves the sea.", "creative", 1.2),
    LabelledPrompt("Write a haiku about rain on a quiet street.", "creative", 0.9),
    LabelledPrompt("Imagine a city floating in the clouds and describe it.", "creative"),
)


@pytest.fixture(scope="session")
def small_recipe() -> ClassifierRecipe:
    return ClassifierRecipe(SMALL_EXAMPLES, seed=3)


@pytest.fixture(scope="session")
def small_classifier(small_recipe: ClassifierRecipe) -> WorkloadClassifier:
    return train_classifier(small_recipe)
