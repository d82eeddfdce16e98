"""The one validator of ``--speculative-config``: vLLM 0.32's schema and the fleet's means."""

from __future__ import annotations

from typing import Any

import pytest

from controller.specconfig import (
    Proposer,
    SpecConfigError,
    arm_config,
    check_vllm_schema,
    parse_arm,
    resolve_on_pool,
)

PROPOSERS = (
    Proposer("ngram", "ngram", 1, 6, tuning=(("prompt_lookup_max", 4),)),
    Proposer("tiny", "draft_model", 1, 4, model="/models/tiny-draft"),
)


@pytest.mark.parametrize(
    "config",
    [
        {"method": "off"},
        {"method": "ngram", "num_speculative_tokens": 3},
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 2,
        },
        {
            "method": "draft_model",
            "model": "m",
            "num_speculative_tokens": 5,
            "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 16, 2], [17, 256, 0]],
        },
        {"method": "eagle3", "model": "h", "num_speculative_tokens": 2},
        {"method": "suffix", "num_speculative_tokens": 8},
        {"method": "mtp", "num_speculative_tokens": 1},
    ],
)
def test_vllm_accepts(config: dict[str, Any]) -> None:
    check_vllm_schema(config)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"method": "magic", "num_speculative_tokens": 3}, "unknown method 'magic'"),
        ({"num_speculative_tokens": 3}, "unknown method None"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min (5) must be <= prompt_lookup_max (2)",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "gamma": 2}, "unknown keys"),
        ({"method": "off", "num_speculative_tokens": 3}, "takes no other keys"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[1, 4, 5]],
            },
            "k must be in [0",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[4, 1, 1]],
            },
            "batch_start <= batch_end",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[1, 8, 1], [8, 9, 2]],
            },
            "not overlap",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": [[1, 8]],
            },
            "[batch_start, batch_end, k]",
        ),
    ],
)
def test_vllm_refuses_with_reason(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecConfigError) as error:
        check_vllm_schema(config)
    assert reason in str(error.value)


def test_resolve_to_the_pools_arm() -> None:
    assert resolve_on_pool({"method": "off"}, "p", PROPOSERS, pinnable=True) == "off"
    ngram = {"method": "ngram", "num_speculative_tokens": 6}
    assert resolve_on_pool(ngram, "p", PROPOSERS, pinnable=True) == "ngram:6"
    draft = {"method": "draft_model", "model": "/models/tiny-draft", "num_speculative_tokens": 2}
    assert resolve_on_pool(draft, "p", PROPOSERS, pinnable=True) == "tiny:2"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            {"method": "eagle3", "model": "h", "num_speculative_tokens": 2},
            "pool 'p' has no 'eagle3' proposer",
        ),
        (
            {"method": "draft_model", "model": "/models/other", "num_speculative_tokens": 2},
            "pool 'p' has no draft model '/models/other'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 7}, "out of range on pool 'p'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}, "can be pinned"),
    ],
)
def test_pool_cannot_run(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecConfigError) as error:
        resolve_on_pool(config, "p", PROPOSERS, pinnable=True)
    assert reason in str(error.value)


def test_arm_round_trip_through_config() -> None:
    config = arm_config("ngram:5", PROPOSERS)
    assert config == {"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 5}
    assert resolve_on_pool(config, "p", PROPOSERS, pinnable=False) == "ngram:5"
    assert arm_config("off", PROPOSERS) is None
    assert parse_arm("tiny:3") == ("tiny", 3)
    with pytest.raises(SpecConfigError, match="outside"):
        arm_config("tiny:9", PROPOSERS)
    with pytest.raises(SpecConfigError, match="gamma must be >= 1"):
        parse_arm("ngram:0")
