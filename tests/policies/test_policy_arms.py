from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.arms import OFF, Arm, ConcurrencyBuckets, Context, arms_from_proposers


def test_parse_and_format() -> None:
    assert Arm.parse("ngram:4") == Arm("ngram", 4)
    assert str(Arm("eagle3", 5)) == "eagle3:5"
    assert Arm.parse("off") is OFF
    assert str(OFF) == "off"
    assert OFF.verify_tokens == 1
    assert Arm("draft", 3).verify_tokens == 4


@pytest.mark.parametrize("text", ["", "ngram", "ngram:x", ":3", "ngram:0", "off:2"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        Arm.parse(text)


@given(st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True), st.integers(1, 32))
def test_round_trip(proposer: str, gamma: int) -> None:
    if proposer == "off":
        return
    arm = Arm(proposer, gamma)
    assert Arm.parse(str(arm)) == arm


def test_arms_from_proposers_lists_off_first() -> None:
    arms = arms_from_proposers({"ngram": [3, 2], "eagle3": [1]})
    assert arms == (OFF, Arm("eagle3", 1), Arm("ngram", 2), Arm("ngram", 3))


def test_default_buckets() -> None:
    buckets = ConcurrencyBuckets()
    assert buckets.labels == ("1", "2-3", "4-7", "8-15", "16-31", "32+")
    assert [buckets.bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 500)] == [
        "1",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "16-31",
        "32+",
        "32+",
    ]
    assert buckets.representative("1") == 1.0
    assert buckets.representative("32+") == 48.0


def test_custom_buckets() -> None:
    buckets = ConcurrencyBuckets.parse("1, 5, 20")
    assert buckets.labels == ("1-4", "5-19", "20+")
    assert buckets.bucket(4) == "1-4"
    with pytest.raises(ValueError):
        ConcurrencyBuckets((2, 4))
    with pytest.raises(ValueError):
        ConcurrencyBuckets((1, 4, 4))


def test_context_text() -> None:
    assert str(Context("llama", "code", "2-3")) == "llama/code/2-3"
