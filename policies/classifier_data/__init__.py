"""The default classifier's labelled prompts, committed as package data.

``default_prompts.jsonl.gz`` was built by ``specpilot classify build-dataset`` (see
:mod:`policies.classifier_data.generate`) from this machine's local material and is
committed, so every install trains the same default model whatever its local files.
Reading it is the only file access in ``policies``: read-only package data, like an
import.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from importlib import resources

from policies.classifier_data.generate import DatasetRow

DEFAULT_DATASET_FILE = "default_prompts.jsonl.gz"
DEFAULT_SEED = 0
"""Seed of the shipped model's training (and of the dataset builder)."""


@cache
def load_default_dataset() -> tuple[DatasetRow, ...]:
    """All rows of the committed default dataset, train and held-out."""
    raw = resources.files(__name__).joinpath(DEFAULT_DATASET_FILE).read_bytes()
    rows = []
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        record = json.loads(line)
        rows.append(
            DatasetRow(
                prompt=record["prompt"],
                workload_class=record["class"],
                temperature=record["temperature"],
                group=record["group"],
                split=record["split"],
            )
        )
    return tuple(rows)
