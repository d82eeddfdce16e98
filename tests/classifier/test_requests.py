"""Which class a request is served under: explicit classes win, in a fixed order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.classifier import (
    TEXT_CLIP_CHARS,
    RequestShapeError,
    UnknownWorkloadClassError,
    WorkloadClassifier,
    clip_text,
    explicit_class,
    prompt_text,
    request_temperature,
)

CODE_BODY = {"prompt": "def add(a, b):\n    return a + b\n", "temperature": 0.0}


def test_model_predicts_when_nothing_is_explicit(small_classifier: WorkloadClassifier) -> None:
    result = small_classifier.classify_request({}, CODE_BODY)
    assert result.source == "model"
    assert result.workload_class == "code"
    assert 0.0 < result.probability <= 1.0


def test_header_wins_over_the_prompt(small_classifier: WorkloadClassifier) -> None:
    result = small_classifier.classify_request({"x-workload-class": " Creative "}, CODE_BODY)
    assert (result.workload_class, result.source, result.probability) == (
        "creative",
        "explicit",
        1.0,
    )


def test_metadata_wins_over_the_prompt(small_classifier: WorkloadClassifier) -> None:
    body = {**CODE_BODY, "metadata": {"workload_class": "structured"}}
    result = small_classifier.classify_request({}, body)
    assert (result.workload_class, result.source) == ("structured", "explicit")


def test_header_wins_over_metadata(small_classifier: WorkloadClassifier) -> None:
    body = {**CODE_BODY, "metadata": {"workload_class": "structured"}}
    result = small_classifier.classify_request({"X-Workload-Class": "creative"}, body)
    assert result.workload_class == "creative"


def test_blank_explicit_values_fall_through_to_the_model(
    small_classifier: WorkloadClassifier,
) -> None:
    body = {**CODE_BODY, "metadata": {"workload_class": "  "}}
    result = small_classifier.classify_request({"X-Workload-Class": ""}, body)
    assert (result.workload_class, result.source) == ("code", "model")


def test_unknown_explicit_class_is_an_error_naming_the_known_ones(
    small_classifier: WorkloadClassifier,
) -> None:
    with pytest.raises(UnknownWorkloadClassError, match="X-Workload-Class") as info:
        small_classifier.classify_request({"X-Workload-Class": "cod"}, CODE_BODY)
    assert "code, creative, structured" in str(info.value)
    with pytest.raises(UnknownWorkloadClassError, match=r"metadata\.workload_class"):
        small_classifier.classify_request({}, {**CODE_BODY, "metadata": {"workload_class": "x"}})


def test_explicit_class_reports_where_it_came_from() -> None:
    assert explicit_class({"X-WORKLOAD-CLASS": "Chat"}, {}) == ("chat", "header X-Workload-Class")
    assert explicit_class({}, {"metadata": {"workload_class": "edit"}}) == (
        "edit",
        "metadata.workload_class",
    )
    assert explicit_class({"Other": "x"}, {"metadata": {}}) is None


@pytest.mark.parametrize(
    "body",
    [{"metadata": "code"}, {"metadata": {"workload_class": 3}}],
)
def test_malformed_metadata_is_rejected(body: dict[str, object]) -> None:
    with pytest.raises(RequestShapeError):
        explicit_class({}, body)


def test_chat_messages_are_joined_text_parts_included() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None},
        ]
    }
    assert prompt_text(body) == "Be brief.\n\nHi\n\n"


def test_completion_prompts_in_every_shape() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["a", "b"]}) == "a\nb"
    assert prompt_text({"prompt": [1, 2, 3]}) == ""
    assert prompt_text({}) == ""
    with pytest.raises(RequestShapeError):
        prompt_text({"prompt": {"text": "x"}})
    with pytest.raises(RequestShapeError):
        prompt_text({"messages": "hello"})


def test_temperature_is_validated() -> None:
    assert request_temperature({}) is None
    assert request_temperature({"temperature": 0}) == 0.0
    for bad in ("0.7", True, -0.1, float("inf")):
        with pytest.raises(RequestShapeError):
            request_temperature({"temperature": bad})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text"]), children, max_size=3
        )
    ),
    max_leaves=8,
)
request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": json_values,
        "messages": json_values,
        "temperature": json_values,
        "metadata": json_values | st.fixed_dictionaries({"workload_class": json_values}),
    },
)


@settings(max_examples=60, deadline=None)
@given(body=request_bodies, header=st.none() | st.text(max_size=12))
def test_any_body_gets_a_known_class_or_a_request_error(
    small_classifier: WorkloadClassifier, body: dict[str, object], header: str | None
) -> None:
    # What a gateway relies on: nothing but these two errors, and never an unknown class.
    headers = {} if header is None else {"X-Workload-Class": header}
    try:
        result = small_classifier.classify_request(headers, body)
    except (RequestShapeError, UnknownWorkloadClassError):
        return
    assert result.workload_class in small_classifier.classes
    assert 0.0 <= result.probability <= 1.0


def test_long_prompts_keep_head_and_tail_only() -> None:
    text = "HEAD " + "x" * 100_000 + " TAIL"
    clipped = clip_text(text)
    assert len(clipped) <= TEXT_CLIP_CHARS + 1
    assert clipped.startswith("HEAD ") and clipped.endswith(" TAIL")
    assert clip_text("short") == "short"
