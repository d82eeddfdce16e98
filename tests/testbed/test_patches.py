"""Applying the testbed's vLLM patches: once, loudly when the installed file differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.patches import Patch, PatchMismatch, apply

PATCH = Patch("demo", "https://example.invalid/1", "pkg/mod.py", "x = 1\n", "x = 2  # fixed\n")


def env_with(tmp_path: Path, text: str) -> Path:
    module = tmp_path / "lib" / "python3.11" / "site-packages" / "pkg" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text(text)
    cache = module.parent / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"stale")
    return tmp_path


def test_applies_once_and_drops_the_stale_bytecode(tmp_path: Path) -> None:
    env = env_with(tmp_path, "a = 0\nx = 1\n")
    module = env / "lib" / "python3.11" / "site-packages" / "pkg" / "mod.py"
    assert apply(env, (PATCH,)) == ["demo"]
    assert module.read_text() == "a = 0\nx = 2  # fixed\n"
    assert not list((module.parent / "__pycache__").iterdir())
    assert apply(env, (PATCH,)) == []
    assert module.read_text() == "a = 0\nx = 2  # fixed\n"


def test_a_file_already_fixed_counts_as_applied(tmp_path: Path) -> None:
    env = env_with(tmp_path, "x = 2  # fixed\n")
    assert apply(env, (PATCH,)) == []
    assert (env / PATCH.marker).exists()


def test_a_different_file_stops_with_the_patch_named(tmp_path: Path) -> None:
    env = env_with(tmp_path, "x = 3\n")
    with pytest.raises(PatchMismatch, match="demo"):
        apply(env, (PATCH,))
    assert not (env / PATCH.marker).exists()
