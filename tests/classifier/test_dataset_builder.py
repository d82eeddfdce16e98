"""The default-dataset builder: deterministic, and honest about its held-out split."""

from __future__ import annotations

import random

import pytest

from policies.classifier_data.generate import (
    SourceDocument,
    build_dataset,
    document_origin,
    row_to_json,
)

PARAGRAPH = (
    "The {w} subsystem keeps a journal of every change so that a crash never leaves "
    "the {w} store half written; readers see either the old or the new state, and the "
    "recovery step replays the journal before anything else runs on {w}."
)


def documents() -> list[SourceDocument]:
    docs = []
    for i, word in enumerate(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]):
        code = "\n".join(
            f"def {word}_{n}(x):\n    y = x + 1\n    if y > 2:\n        y -= 1\n"
            "    z = y * 2\n    return z\n"
            for n in range(4)
        )
        docs.append(SourceDocument(f"stdlib:{word}.py", code, "code", "python"))
        prose = "\n\n".join(PARAGRAPH.format(w=f"{word}{k}") for k in range(3))
        docs.append(SourceDocument(f"doc:pkg{i}/README.md", prose, "prose", "text"))
    return docs


def test_same_documents_and_seed_give_the_same_rows() -> None:
    docs = documents()
    shuffled = list(docs)
    random.Random(5).shuffle(shuffled)
    first = build_dataset(docs, seed=1, rows_per_class=20)
    assert [row_to_json(r) for r in first] == [
        row_to_json(r) for r in build_dataset(shuffled, seed=1, rows_per_class=20)
    ]
    assert [r.prompt for r in first] != [
        r.prompt for r in build_dataset(docs, seed=2, rows_per_class=20)
    ]


def test_held_out_rows_come_from_held_out_documents_and_templates() -> None:
    rows = build_dataset(documents(), seed=0, rows_per_class=40)
    by_split = {
        split: {document_origin(r.group) for r in rows if r.split == split}
        for split in ("train", "test")
    }
    assert by_split["train"].isdisjoint(by_split["test"])
    assert {r.workload_class for r in rows if r.split == "test"} == {
        "code",
        "structured",
        "edit",
        "chat",
        "creative",
    }


def test_too_little_material_is_refused() -> None:
    one_origin = [d for d in documents() if d.name in {"stdlib:alpha.py", "doc:pkg0/README.md"}]
    with pytest.raises(ValueError, match="at least two origins"):
        build_dataset(one_origin, seed=0)
