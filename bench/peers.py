"""The proxies users would run instead of specpilot's gateway, prepared once and cached.

``bench gateway --peers`` puts two of them in front of the same upstream as the gateway:

- nginx, from Debian's package (``apt-get install nginx``; installed here when missing
  and running as root): a C reverse proxy, the floor for any HTTP hop;
- the LiteLLM proxy (PyPI ``litellm[proxy]``, pinned below), in its own virtual
  environment under ``cache_root()`` (``~/.cache/specpilot``), never in the project's:
  its pins are not ours and specpilot only talks to it over HTTP.

Both are configured here for a bench run: nginx with a generated config in a temporary
folder (no root paths, no logs on the hot path, unbuffered keep-alive upstream), LiteLLM
with a config file naming the upstream as an OpenAI-compatible ``hosted_vllm`` backend.

The LiteLLM version is pinned exactly, to a release from before the known compromised
ones (1.82.7 and 1.82.8, and 1.107.0, all withdrawn from PyPI); after installing, the
environment is checked for the ``.pth`` start-up hook those carried.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from testbed.environment import _fix_script_paths, cache_root

LITELLM_PACKAGE = "litellm[proxy]==1.81.13"
# A start-up hook the compromised LiteLLM releases installed into site-packages.
_SUSPECT_HOOKS = ("litellm_init.pth",)


def _log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


class PeerUnavailable(RuntimeError):
    """A peer proxy cannot be prepared here; the message says how to provide it."""


def installed_nginx() -> Path | None:
    """The nginx binary, where one is installed (root's PATH holds /usr/sbin, a user's
    may not)."""
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    return Path(found) if found else None


def ensure_nginx() -> Path:
    """The nginx binary, installed from Debian's package when missing (as root)."""
    found = installed_nginx()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PeerUnavailable(
            "nginx is not installed: run `apt-get update && apt-get install -y nginx` as root"
        )
    _log("installing nginx from Debian's packages (once)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx"],
        check=True,
        env=env,
    )
    # Where a package start is allowed it runs the system's nginx on port 80; the bench
    # runs its own.
    if shutil.which("systemctl"):
        subprocess.run(["systemctl", "disable", "--now", "nginx"], check=False, capture_output=True)
    return ensure_nginx()


def litellm_env() -> Path:
    name = LITELLM_PACKAGE.replace("[proxy]", "-proxy").replace("==", "-")
    return cache_root() / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}"


def ensure_litellm() -> Path:
    """The ``litellm`` console script of a cached virtual environment (installed once)."""
    env = litellm_env()
    script = env / "bin" / "litellm"
    if (env / ".complete").exists() and script.exists():
        return script
    partial = env.with_name(env.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _log(f"installing {LITELLM_PACKAGE} into {env} (a few minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True)
    pip = [str(partial / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", LITELLM_PACKAGE], check=True)
    hooks = [
        p for name in _SUSPECT_HOOKS for p in partial.glob(f"lib/python*/site-packages/{name}")
    ]
    if hooks:
        shutil.rmtree(partial, ignore_errors=True)
        raise PeerUnavailable(f"{LITELLM_PACKAGE} installed a suspect start-up hook: {hooks}")
    shutil.rmtree(env, ignore_errors=True)
    partial.rename(env)
    _fix_script_paths(env, partial)
    subprocess.run(
        [str(env / "bin" / "python"), "-c", "import litellm.proxy.proxy_server"],
        check=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    (env / ".complete").write_text(LITELLM_PACKAGE + "\n")
    return script
