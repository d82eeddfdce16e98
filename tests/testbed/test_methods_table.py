"""The acceptance table's arithmetic and its place in docs/testbed.md (no vLLM here: the
measurement itself runs in tests/e2e/test_testbed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.methods import TABLE_MARKERS, Cell, table_markdown, write_table
from testbed.traffic import CLASSES, class_body, class_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testbed.md"


def cell(workload: str, spec: str, temperature: float, drafted: int, accepted: int) -> Cell:
    return Cell(workload, spec, temperature, 2, drafted, accepted, spec_steps=drafted // 4)


def test_acceptance_and_tokens_per_verify_come_from_the_counts() -> None:
    c = cell("code", "ngram:4", 0.0, drafted=40, accepted=30)
    assert c.acceptance == 0.75
    assert c.tokens_per_verify == 1 + 30 / 10
    idle = cell("creative", "ngram:4", 1.0, drafted=0, accepted=0)
    assert idle.acceptance is None and idle.tokens_per_verify == 1.0


def test_table_has_a_row_per_class_and_proposer_and_a_column_per_temperature() -> None:
    cells = [
        cell(w, s, t, drafted=40, accepted=10 * i)
        for i, w in enumerate(CLASSES)
        for s in ("ngram:4", "eagle:3")
        for t in (0.0, 1.0)
    ]
    lines = table_markdown(cells).splitlines()
    assert lines[0] == "| class | proposer | T = 0 | T = 1 |"
    assert len(lines) == 2 + len(CLASSES) * 2
    assert lines[2] == "| code | ngram:4 | 0.00 / 1.00 | 0.00 / 1.00 |"
    assert lines[4] == "| json | ngram:4 | 0.25 / 2.00 | 0.25 / 2.00 |"


def test_write_table_replaces_only_the_marked_section(tmp_path: Path) -> None:
    start, end = TABLE_MARKERS
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{start}\nold table\n{end}\nafter\n")
    write_table(doc, "| new |")
    assert doc.read_text() == f"before\n{start}\n| new |\n{end}\nafter\n"
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("no markers\n")
    with pytest.raises(ValueError, match="no <!-- acceptance-table -->"):
        write_table(unmarked, "| new |")
    assert unmarked.read_text() == "no markers\n"


def test_the_testbed_doc_has_the_table_section() -> None:
    text = DOC.read_text()
    assert all(text.count(marker) == 1 for marker in TABLE_MARKERS)


def test_every_class_has_prompts_and_an_endpoint() -> None:
    for workload in CLASSES:
        bodies = [class_body(workload, i, 16, 0.7) for i in range(3)]
        texts = [str(b.get("prompt") or b["messages"]) for b in bodies]
        assert len(set(texts)) > 1, workload
        assert all(b["temperature"] == 0.7 and b["max_tokens"] == 16 for b in bodies)
        assert class_path(workload) == (
            "/v1/chat/completions" if workload == "chat" else "/v1/completions"
        )
    with pytest.raises(ValueError, match="unknown workload class"):
        class_body("poetry", 0, 16, 0.0)
