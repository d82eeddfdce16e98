"""Random but plausible scenarios, for testing policies on fleets nobody tuned them on."""

from __future__ import annotations

from typing import Any

import numpy as np

_PROPOSERS = {
    "eagle3": (0.02, 0.06, [1, 2, 3, 4, 5, 6, 8]),
    "draft": (0.06, 0.15, [2, 3, 4, 6]),
    "ngram": (0.002, 0.01, [2, 3, 4, 5, 6]),
}
_CLASSES = ("code", "json", "edit", "chat", "rag", "creative")


def random_scenario(
    seed: int, duration_s: float = 1800.0, *, stationary: bool = False
) -> dict[str, Any]:
    """A scenario dict (see :mod:`simulator.scenario`) drawn from ``seed``.

    Two or three proposers, two to five classes with random shares and acceptances
    (n-gram bimodal: great on copy-heavy classes, useless elsewhere), three to five
    load phases between 1 and 64 streams, and up to two drift events. ``stationary``
    keeps the first phase's load for the whole run and drops the drift events (the
    same draws otherwise, so the fleet and classes are the seed's).
    """
    rng = np.random.default_rng(seed)
    names = list(_PROPOSERS)
    chosen = sorted(rng.choice(names, size=int(rng.integers(2, 4)), replace=False).tolist())
    proposers = {}
    for name in chosen:
        low, high, gammas = _PROPOSERS[name]
        proposers[name] = {"draft_cost": round(float(rng.uniform(low, high)), 4), "gammas": gammas}
    count = int(rng.integers(2, 6))
    class_names = sorted(rng.choice(_CLASSES, size=count, replace=False).tolist())
    shares = rng.dirichlet(np.full(count, 2.0))
    shares = np.round(shares, 3)
    shares[-1] = round(1.0 - float(shares[:-1].sum()), 3)
    classes: dict[str, Any] = {}
    for name, share in zip(class_names, shares, strict=True):
        acceptance = {}
        for proposer in chosen:
            if proposer == "ngram":
                alpha = rng.uniform(0.6, 0.92) if rng.random() < 0.4 else rng.uniform(0.02, 0.3)
            else:
                alpha = rng.uniform(0.35, 0.88)
            acceptance[proposer] = round(float(alpha), 2)
        classes[name] = {
            "share": float(share),
            "output_tokens": int(rng.choice([96, 160, 256, 384, 512])),
            "acceptance": acceptance,
        }
    phase_count = int(rng.integers(3, 6))
    starts = np.sort(rng.uniform(0, duration_s, size=phase_count - 1))
    levels = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    phases = [{"at_s": 0.0, "concurrency": int(rng.choice(levels))}]
    phases += [{"at_s": round(float(t)), "concurrency": int(rng.choice(levels))} for t in starts]
    drift = []
    for _ in range(int(rng.integers(0, 3))):
        drift.append(
            {
                "at_s": round(float(rng.uniform(0.2, 0.8) * duration_s)),
                "class": str(rng.choice(class_names)),
                "proposer": str(rng.choice(chosen)),
                "acceptance": round(float(rng.uniform(0.05, 0.5)), 2),
            }
        )
    if stationary:
        phases, drift = phases[:1], []
    return {
        "seed": seed,
        "duration_s": duration_s,
        "model": {
            "step_ms": round(float(rng.uniform(15, 40)), 1),
            "knee_tokens": int(rng.choice([32, 48, 64, 96, 128])),
        },
        "proposers": proposers,
        "classes": classes,
        "phases": phases,
        "drift": drift,
    }
