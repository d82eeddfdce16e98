"""``specpilot bench loop --mix``: what an operator types becomes the traffic, or a clear error."""

from __future__ import annotations

import argparse

import pytest

from bench.loop import MIX, add_arguments, parse_mix


def test_mix_parses_classes_and_temperatures() -> None:
    assert parse_mix("code:0,json:1") == (("code", 0.0), ("json", 1.0))
    assert parse_mix("creative:0.7") == (("creative", 0.7),)
    assert parse_mix("code") == (("code", 0.0),)  # greedy unless told


@pytest.mark.parametrize(
    ("text", "message"),
    [("prose:1", "unknown workload class 'prose'"), ("code:hot", "temperature is not a number")],
)
def test_a_bad_mix_is_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_mix(text)


def test_the_default_mix_has_a_class_that_pays_for_speculation_and_one_that_does_not() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).mix == MIX == (("code", 0.0), ("json", 1.0))
    assert parser.parse_args(["--mix", "code:0"]).mix == (("code", 0.0),)
