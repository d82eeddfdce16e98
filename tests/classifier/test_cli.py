"""`specpilot classify`: retrain with the operator's own classes, predict, report bad lines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from policies import classifier_cli

SQL = [
    "SELECT name FROM users WHERE id = 7;",
    "SELECT count(*) FROM orders GROUP BY customer_id;",
    "UPDATE accounts SET balance = balance - 10 WHERE id = 2;",
    "INSERT INTO items (sku, price) VALUES ('a1', 3.5);",
    "DELETE FROM sessions WHERE expires_at < now();",
    "SELECT o.id, c.name FROM orders o JOIN customers c ON o.cid = c.id;",
]
GREETINGS = [
    "Hello, how are you today?",
    "Good morning! Nice to meet you.",
    "Hi there, hope your week is going well.",
    "Hey, long time no see!",
    "Good evening, how was your day?",
    "Hello again, thanks for your help yesterday.",
]
POETRY = [
    "Write a poem about the quiet winter forest.",
    "Compose verses on the silver moon above the sea.",
    "A sonnet about the rain, please, soft and slow.",
    "Write a short poem on autumn leaves falling.",
    "Rhyming lines about stars and the night sky.",
    "Write a poem about a lonely lighthouse.",
]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="specpilot")
    classifier_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code: int = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def write_labelled(path: Path) -> None:
    lines = (
        [{"prompt": p, "class": "sql", "temperature": 0.0} for p in SQL]
        + [{"prompt": p, "class": "greeting"} for p in GREETINGS]
        + [{"prompt": p, "class": "Poetry", "temperature": 1.0} for p in POETRY]
    )
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")


def test_train_then_classify_with_custom_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, model = tmp_path / "labelled.jsonl", tmp_path / "model.json"
    write_labelled(data)
    code, out, _ = run(["classify", "train", "--data", str(data), "--out", str(model)], capsys)
    assert code == 0
    assert "greeting=6, poetry=6, sql=6" in out

    code, out, _ = run(["classify", "classes", "--model", str(model)], capsys)
    assert (code, out.split()) == (0, ["greeting", "poetry", "sql"])

    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            json.dumps(body)
            for body in [
                {"prompt": "SELECT email FROM users WHERE active = 1;", "id": "q1"},
                {"messages": [{"role": "user", "content": "Hi! How are you doing?"}]},
                {"prompt": "Write a poem about the sea at dawn.", "temperature": 1.0},
                {"prompt": "SELECT 1;", "metadata": {"workload_class": "Greeting"}},
            ]
        ),
        encoding="utf-8",
    )
    code, out, _ = run(["classify", "--model", str(model), "--input", str(requests)], capsys)
    assert code == 0
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["class"] for r in results] == ["sql", "greeting", "poetry", "greeting"]
    assert [r["source"] for r in results] == ["model", "model", "model", "explicit"]
    assert [r["line"] for r in results] == [1, 2, 3, 4]
    assert results[0]["id"] == "q1"
    assert all(0.0 < r["probability"] <= 1.0 for r in results)


def test_bad_training_line_is_reported_with_its_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, model = tmp_path / "labelled.jsonl", tmp_path / "model.json"
    data.write_text(
        '{"prompt": "SELECT 1;", "class": "sql"}\n{"prompt": "hi", "class": "greeting"}\n'
        '{"prompt": "oops", "label": "sql"}\n',
        encoding="utf-8",
    )
    code, _, err = run(["classify", "train", "--data", str(data), "--out", str(model)], capsys)
    assert code == 2
    assert f"{data}:3: 'class' must be a string" in err
    assert not model.exists()


def test_bad_request_line_is_reported_before_any_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, model = tmp_path / "labelled.jsonl", tmp_path / "model.json"
    write_labelled(data)
    run(["classify", "train", "--data", str(data), "--out", str(model)], capsys)
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "SELECT 1;"}\n\n{"temperature": 0}\n', encoding="utf-8")
    code, out, err = run(["classify", "--model", str(model), "--input", str(requests)], capsys)
    assert (code, out) == (2, "")
    assert f"{requests}:3: needs 'prompt' or 'messages'" in err

    requests.write_text('{"prompt": "x", "metadata": {"workload_class": "nope"}}\n')
    code, out, err = run(["classify", "--model", str(model), "--input", str(requests)], capsys)
    assert (code, out) == (2, "")
    assert f"{requests}:1: workload class 'nope'" in err


def test_model_file_that_is_not_a_model_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "model.json"
    bogus.write_text('{"weights": []}', encoding="utf-8")
    code, _, err = run(["classify", "classes", "--model", str(bogus)], capsys)
    assert code == 2
    assert "not a classifier model file" in err
