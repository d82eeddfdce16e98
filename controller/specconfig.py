"""vLLM's ``--speculative-config``: the one place that says what is valid and what runs.

Two questions, asked by the settings (each pool's running config), the override API
(what an operator pins) and the actuators (what is pushed):

- ``check_vllm_schema``: would vLLM 0.32 accept this JSON at all? Known method, known
  keys, 1 ≤ ``num_speculative_tokens`` ≤ 128, ``prompt_lookup_min`` ≤ ``prompt_lookup_max``,
  ``num_speculative_tokens_per_batch_size`` as inclusive ``[start, end, k]`` ranges.
- ``resolve_on_pool``: can this pool run it? Its method (and draft model, where the
  method needs one) must be one of the pool's proposers and γ inside that proposer's
  range. The answer is the arm, the policy's unit of choice.

An arm's text form is ``"<proposer>:<γ>"`` or ``"off"``, where a proposer is a name
the fleet settings give to one way of drafting on a pool (``ngram``, ``tiny-draft``).
``{"method": "off"}`` is specpilot's spelling of "no ``--speculative-config``".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.arms import Arm

OFF = "off"

# vLLM 0.32 SpeculativeConfig.method values (the MTP family shares one code path).
VLLM_METHODS: frozenset[str] = frozenset(
    {
        "ngram",
        "draft_model",
        "eagle",
        "eagle3",
        "medusa",
        "mlp_speculator",
        "suffix",
        "mtp",
        "deepseek_mtp",
        "ernie_mtp",
        "qwen3_next_mtp",
        "longcat_flash_mtp",
    }
)
# Methods that draft with a separate checkpoint named by "model".
METHODS_WITH_DRAFT_MODEL: frozenset[str] = frozenset(
    {"draft_model", "eagle", "eagle3", "medusa", "mlp_speculator"}
)
VLLM_KEYS: frozenset[str] = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "num_speculative_tokens_per_batch_size",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "draft_tensor_parallel_size",
        "draft_load_config",
        "quantization",
        "max_model_len",
        "revision",
        "code_revision",
        "disable_by_batch_size",
        "disable_padded_drafter_batch",
        "rejection_sample_method",
        "synthetic_acceptance_rates",
        "synthetic_acceptance_length",
        "speculative_token_tree",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "enforce_eager",
    }
)
MAX_SPECULATIVE_TOKENS = 128
"""The most draft tokens vLLM 0.32 verifies per request and step: ``MAX_SPEC_LEN`` in
``vllm/v1/sample/rejection_sampler.py`` ("Maximum number of speculative draft tokens
allowed per request in a single step"), which the rejection sampler asserts. Its config
schema sets no upper bound, so a larger γ starts and fails at the first verify step."""
# Simulated acceptance for rejection_sample_method "synthetic" (vLLM wants exactly one).
SYNTHETIC_KEYS: tuple[str, ...] = ("synthetic_acceptance_rates", "synthetic_acceptance_length")
# What an operator may pin: the arm. How a proposer is tuned comes from the fleet settings.
PINNABLE_KEYS: frozenset[str] = frozenset({"method", "model", "num_speculative_tokens"})


class SpecConfigError(ValueError):
    """A speculative config vLLM would refuse, or that the fleet cannot run; the message
    is the reason, shown to operators as is."""


def _int(
    config: Mapping[str, Any], key: str, minimum: int, maximum: int | None = None
) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise SpecConfigError(f"{key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecConfigError(f"{key} must be <= {maximum} (what vLLM verifies), got {value}")
    return value


def _check_batch_ranges(value: object, gamma: int) -> None:
    if not isinstance(value, list) or not value:
        raise SpecConfigError(
            "num_speculative_tokens_per_batch_size must be a non-empty list of "
            "[batch_start, batch_end, k] ranges"
        )
    previous_end = 0
    for i, entry in enumerate(value):
        where = f"num_speculative_tokens_per_batch_size[{i}]"
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)
        ):
            raise SpecConfigError(f"{where} must be [batch_start, batch_end, k] integers")
        start, end, k = entry
        if start < 1 or end < start:
            raise SpecConfigError(f"{where}: need 1 <= batch_start <= batch_end, got {entry}")
        if start <= previous_end:
            raise SpecConfigError(f"{where}: ranges must be increasing and not overlap")
        if not 0 <= k <= gamma:
            raise SpecConfigError(f"{where}: k must be in [0, num_speculative_tokens={gamma}]")
        previous_end = end


def check_vllm_schema(config: Mapping[str, Any]) -> None:
    """Raise ``SpecConfigError`` unless vLLM 0.32 would accept ``config`` as
    ``--speculative-config`` (``{"method": "off"}`` is accepted: no speculation)."""
    method = config.get("method")
    if method == OFF:
        extra = set(config) - {"method"}
        if extra:
            raise SpecConfigError(f"method 'off' takes no other keys, got {sorted(extra)}")
        return
    if not isinstance(method, str) or method not in VLLM_METHODS:
        known = ", ".join(sorted(VLLM_METHODS | {OFF}))
        raise SpecConfigError(f"unknown method {method!r} (known: {known})")
    unknown = set(config) - VLLM_KEYS
    if unknown:
        raise SpecConfigError(f"unknown keys for vLLM 0.32: {sorted(unknown)}")
    gamma = _int(config, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if gamma is None:
        raise SpecConfigError("num_speculative_tokens is required (>= 1)")
    if method == "ngram":
        low = _int(config, "prompt_lookup_min", 1)
        high = _int(config, "prompt_lookup_max", 1)
        if low is not None and high is not None and low > high:
            raise SpecConfigError(
                f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
            )
    if method in METHODS_WITH_DRAFT_MODEL:
        model = config.get("model")
        if not isinstance(model, str) or not model:
            raise SpecConfigError(f"method {method!r} needs 'model' (the draft checkpoint)")
    if "num_speculative_tokens_per_batch_size" in config:
        _check_batch_ranges(config["num_speculative_tokens_per_batch_size"], gamma)
    synthetic = [k for k in SYNTHETIC_KEYS if k in config]
    if config.get("rejection_sample_method") == "synthetic" and len(synthetic) != 1:
        raise SpecConfigError(
            "rejection_sample_method 'synthetic' needs exactly one of "
            + " or ".join(SYNTHETIC_KEYS)
        )


@dataclass(frozen=True, slots=True)
class Proposer:
    """One way a pool can draft: a vLLM method, its draft checkpoint if any, its γ range
    (inclusive), and the tuning keys it always runs with (e.g. ``prompt_lookup_max``)."""

    name: str
    method: str
    gamma_min: int
    gamma_max: int
    model: str | None = None
    tuning: tuple[tuple[str, Any], ...] = ()

    def config(self, gamma: int) -> dict[str, Any]:
        """The ``--speculative-config`` that runs this proposer with γ draft tokens."""
        config: dict[str, Any] = {"method": self.method}
        if self.model is not None:
            config["model"] = self.model
        config.update(self.tuning)
        config["num_speculative_tokens"] = gamma
        return config


def parse_arm(arm: str) -> tuple[str, int] | None:
    """``"ngram:4"`` → ``("ngram", 4)``; ``"off"`` → None (text form of ``policies.arms.Arm``)."""
    try:
        parsed = Arm.parse(arm)
    except ValueError as error:
        raise SpecConfigError(str(error)) from None
    if parsed.proposer is None:
        return None
    return parsed.proposer, parsed.gamma


def arm_config(arm: str, proposers: Sequence[Proposer]) -> dict[str, Any] | None:
    """The config that runs ``arm`` with these proposers; None for off."""
    parsed = parse_arm(arm)
    if parsed is None:
        return None
    name, gamma = parsed
    for proposer in proposers:
        if proposer.name == name:
            if not proposer.gamma_min <= gamma <= proposer.gamma_max:
                raise SpecConfigError(
                    f"gamma {gamma} outside [{proposer.gamma_min}, {proposer.gamma_max}] "
                    f"for proposer {name!r}"
                )
            return proposer.config(gamma)
    raise SpecConfigError(f"no proposer named {name!r}")


def resolve_on_pool(
    config: Mapping[str, Any], pool: str, proposers: Sequence[Proposer], *, pinnable: bool
) -> str:
    """The arm that runs ``config`` on a pool offering ``proposers``.

    Raises ``SpecConfigError`` naming the pool when the pool cannot run it: a method it
    has no proposer for, a draft model it lacks, γ out of the proposer's range. With
    ``pinnable`` (operator overrides) only the arm's keys may be given.
    """
    check_vllm_schema(config)
    if config["method"] == OFF:
        return OFF
    if pinnable:
        extra = set(config) - PINNABLE_KEYS
        if extra:
            raise SpecConfigError(
                f"only {sorted(PINNABLE_KEYS)} can be pinned, got {sorted(extra)}: "
                "proposer tuning comes from the fleet settings"
            )
    method, model, gamma = config["method"], config.get("model"), config["num_speculative_tokens"]
    candidates = [p for p in proposers if p.method == method]
    if not candidates:
        offered = sorted({p.method for p in proposers}) or ["none"]
        raise SpecConfigError(
            f"pool {pool!r} has no {method!r} proposer (it offers: {', '.join(offered)})"
        )
    if model is not None:
        candidates = [p for p in candidates if p.model == model]
        if not candidates:
            raise SpecConfigError(f"pool {pool!r} has no draft model {model!r} for {method!r}")
    in_range = [p for p in candidates if p.gamma_min <= gamma <= p.gamma_max]
    if not in_range:
        ranges = ", ".join(f"[{p.gamma_min}, {p.gamma_max}]" for p in candidates)
        raise SpecConfigError(
            f"num_speculative_tokens={gamma} is out of range on pool {pool!r} "
            f"for {method!r} (allowed: {ranges})"
        )
    return f"{in_range[0].name}:{gamma}"
