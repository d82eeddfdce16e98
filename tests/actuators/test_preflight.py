"""Preflight: vLLM's schema and the draft/target tokenizer comparison, before any push."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.preflight import (
    Preflight,
    PreflightError,
    local_model_dir,
    tokenizer_mismatch,
)
from controller.fleet import PoolConfig

TOKENIZER = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}}}


def make_checkpoint(
    path: Path, *, vocab_extra: str | None = None, template: str = "{{ m }}"
) -> Path:
    """A checkpoint folder with the tokenizer files a Llama-style model ships."""
    path.mkdir(parents=True)
    tokenizer = json.loads(json.dumps(TOKENIZER))
    if vocab_extra:
        tokenizer["model"]["vocab"][vocab_extra] = 3
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "name_or_path": str(path), "model_max_length": 1024})
    )
    (path / "chat_template.jinja").write_text(template + "\n")
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


def draft(model: Path, gamma: int = 3) -> PoolConfig:
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": gamma}
    return PoolConfig("chat", config, ())


def test_same_tokenizer_saved_differently_matches(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "target")
    other = make_checkpoint(tmp_path / "draft")
    # Same content, other key order and whitespace, CRLF template: still the same tokenizer.
    data = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(dict(reversed(list(data.items())))))
    (other / "chat_template.jinja").write_bytes(b"{{ m }}\r\n")
    assert tokenizer_mismatch(target, other) is None
    Preflight({"chat": str(target)}).check(draft(other))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda p: make_checkpoint(p, vocab_extra="abc"), "tokenizer.json"),
        (lambda p: make_checkpoint(p, template="{{ other }}"), "chat_template.jinja"),
        (
            lambda p: (make_checkpoint(p) / "special_tokens_map.json").write_text("{}"),
            "special_tokens_map.json",
        ),
    ],
)
def test_a_differing_file_is_refused_by_name(tmp_path: Path, change: object, named: str) -> None:
    target = make_checkpoint(tmp_path / "target")
    change(tmp_path / "draft")  # type: ignore[operator]
    reason = tokenizer_mismatch(target, tmp_path / "draft")
    assert reason is not None and reason.startswith(named)
    with pytest.raises(PreflightError, match=f"pool 'chat': draft model refused: {named}"):
        Preflight({"chat": str(target)}).check(draft(tmp_path / "draft"))


def test_a_draft_that_cannot_be_compared_is_refused_unless_allowed(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "target")
    with pytest.raises(PreflightError, match="draft checkpoint 'org/absent' is not readable"):
        Preflight({"chat": str(target)}).check(draft(Path("org/absent")))
    with pytest.raises(PreflightError, match="the target checkpoint '/no/such/dir'"):
        Preflight({"chat": "/no/such/dir"}).check(draft(target))
    # No target named for the pool: its checkpoints live elsewhere; schema only.
    Preflight({}).check(draft(Path("org/absent")))
    Preflight({"chat": str(target)}, allow_unverified_drafts=True).check(draft(Path("org/absent")))


def test_hugging_face_cache_snapshots_are_found(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    snapshot = make_checkpoint(repo / "snapshots" / "abc123")
    assert local_model_dir("org/tiny", hf_home=tmp_path) == snapshot
    assert local_model_dir("org/other", hf_home=tmp_path) is None


def test_schema_is_checked_by_the_one_validator() -> None:
    preflight = Preflight()
    preflight.check(PoolConfig("chat", None, ()))
    preflight.check(PoolConfig("chat", {"method": "ngram", "num_speculative_tokens": 3}, ()))
    with pytest.raises(PreflightError, match="num_speculative_tokens must be >= 1"):
        preflight.check(PoolConfig("chat", {"method": "ngram", "num_speculative_tokens": 0}, ()))
    bad_table = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [3, 8, 0]],
    }
    with pytest.raises(PreflightError, match="overlap"):
        preflight.check(PoolConfig("chat", bad_table, ()))
    synthetic: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 2}
    synthetic["rejection_sample_method"] = "synthetic"
    with pytest.raises(PreflightError, match="exactly one of synthetic_acceptance_rates"):
        preflight.check(PoolConfig("chat", synthetic, ()))
    synthetic["synthetic_acceptance_rates"] = [0.8, 0.5]
    preflight.check(PoolConfig("chat", synthetic, ()))
    # EAGLE heads share the target's embedding: no tokenizer files to compare.
    preflight.check(
        PoolConfig("chat", {"method": "eagle", "model": "/x", "num_speculative_tokens": 2}, ())
    )


def test_testbed_draft_with_a_modified_tokenizer_is_refused(tmp_path: Path) -> None:
    """On the testbed's real checkpoints: its drafts match the target byte for byte; a
    copy with one token renamed in tokenizer.json does not."""
    from testbed.environment import ModelSet

    models = ModelSet.default()
    if not models.ready:
        pytest.skip("testbed models not built: run `specpilot testbed ensure`")
    original = models.draft
    preflight = Preflight({"chat": str(models.target)})
    preflight.check(draft(original))

    copy = tmp_path / "draft"
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((copy / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_renamed"] = vocab.pop(first)
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(PreflightError, match=r"tokenizer\.json differs"):
        preflight.check(draft(copy))
