"""What every actuator checks before a config leaves specpilot.

Two checks, cheap enough to run on every push:

- the vLLM 0.32 schema (``controller.specconfig.check_vllm_schema``, the one validator);
- a draft model must tokenize exactly like its target and format chats the same way: a
  draft with another vocabulary or chat template starts fine and silently accepts almost
  nothing. ``tokenizer_mismatch`` compares the tokenizer and chat-template files of the
  two checkpoints by a normalized hash (JSON parsed and re-serialized with sorted keys,
  minus keys that name the checkpoint rather than the tokenizer; text files with
  normalized line endings), and names the first file that differs.

A failed check raises ``PreflightError`` (a ``SpecConfigError``: the message is the
reason, shown to operators as is) before any file is written, request sent or process
started.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.fleet import PoolConfig
from controller.specconfig import SpecConfigError, check_vllm_schema

log = logging.getLogger(__name__)

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files that decide how text becomes tokens and how a chat becomes text."""
IGNORED_JSON_KEYS: frozenset[str] = frozenset({"name_or_path", "_name_or_path", "tokenizer_file"})
"""Keys that record where a checkpoint was saved from, not how it tokenizes."""
# Of the methods with a "model", the EAGLE/Medusa/MLP heads read the target's hidden
# states and share its embedding (they often ship no tokenizer at all): only a standalone
# draft model must carry the same tokenizer files.
STANDALONE_DRAFT_METHODS: frozenset[str] = frozenset({"draft_model"})


class PreflightError(SpecConfigError):
    """A config that must not be pushed; the message says why."""


def _normalized(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.suffix == ".json":
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in IGNORED_JSON_KEYS}
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    if path.suffix in {".jinja", ".txt"}:
        return raw.replace(b"\r\n", b"\n").rstrip()
    return raw


def tokenizer_fingerprint(model_dir: Path) -> dict[str, str]:
    """File name → SHA-256 of its normalized content, for the tokenizer files present."""
    return {
        name: hashlib.sha256(_normalized(model_dir / name)).hexdigest()
        for name in TOKENIZER_FILES
        if (model_dir / name).is_file()
    }


def tokenizer_mismatch(target_dir: Path, draft_dir: Path) -> str | None:
    """None when the draft tokenizes and templates like the target, else the reason,
    naming the first differing file."""
    target, draft = tokenizer_fingerprint(target_dir), tokenizer_fingerprint(draft_dir)
    if "tokenizer.json" not in target and "tokenizer.model" not in target:
        return f"target {target_dir} has no tokenizer.json or tokenizer.model to compare"
    for name in TOKENIZER_FILES:
        if name not in target and name not in draft:
            continue
        if name not in draft:
            return f"{name} is in the target {target_dir} but not in the draft {draft_dir}"
        if name not in target:
            return f"{name} is in the draft {draft_dir} but not in the target {target_dir}"
        if target[name] != draft[name]:
            return f"{name} differs between the target {target_dir} and the draft {draft_dir}"
    return None


def local_model_dir(model: str, hf_home: Path | None = None) -> Path | None:
    """Where a checkpoint's files are on this machine: a directory as given, else the
    Hugging Face cache's snapshot of ``org/name`` at ``refs/main``; None if neither."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if hf_home is None:
        hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    repo = hf_home / "hub" / f"models--{model.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    return None


@dataclass
class Preflight:
    """Checks a pool's config before it is pushed.

    ``target_models`` maps a pool to its target checkpoint (a directory or a Hugging
    Face id in the local cache). For such a pool a draft-model config is compared with
    it, and refused when the draft's or the target's files cannot be read here unless
    ``allow_unverified_drafts``: pushing a draft nobody compared is how acceptance
    silently collapses. A pool with no target named (the checkpoints live elsewhere,
    e.g. behind an orchestrator) gets the schema check only, and a warning once.
    """

    target_models: Mapping[str, str] = field(default_factory=dict)
    allow_unverified_drafts: bool = False
    hf_home: Path | None = None
    _warned: set[str] = field(default_factory=set, repr=False)

    def check(self, pool_config: PoolConfig) -> None:
        config = pool_config.config
        if config is None:
            return
        self.check_config(pool_config.pool, config)

    def check_config(self, pool: str, config: Mapping[str, Any]) -> None:
        try:
            check_vllm_schema(config)
        except SpecConfigError as exc:
            raise PreflightError(f"pool {pool!r}: {exc}") from None
        if config["method"] in STANDALONE_DRAFT_METHODS:
            self._check_draft(pool, str(config["model"]))

    def _check_draft(self, pool: str, draft: str) -> None:
        target = self.target_models.get(pool)
        if target is None:
            if pool not in self._warned:
                self._warned.add(pool)
                log.warning(
                    "pool %s: no target checkpoint configured; draft tokenizers unchecked", pool
                )
            return
        target_dir = local_model_dir(target, self.hf_home)
        draft_dir = local_model_dir(draft, self.hf_home)
        if target_dir is None or draft_dir is None:
            if self.allow_unverified_drafts:
                return
            missing, name = ("target", target) if target_dir is None else ("draft", draft)
            raise PreflightError(
                f"pool {pool!r}: cannot compare the draft's tokenizer with the target's: "
                f"the {missing} checkpoint {name!r} is not readable here"
            )
        # Not cached: a checkpoint rebuilt in place must be compared again.
        reason = tokenizer_mismatch(target_dir, draft_dir)
        if reason is not None:
            raise PreflightError(f"pool {pool!r}: draft model refused: {reason}")
