"""A replica reduced to its leadership: prints ``leader`` / ``follower`` on every change.

Run by test_leader.py as a real process (``python leader_worker.py URL INTERVAL_S``).
"""

from __future__ import annotations

import sys
import time

from controller.store.leader import AdvisoryLockLeader


def main() -> None:
    leadership = AdvisoryLockLeader(sys.argv[1])
    interval = float(sys.argv[2])
    last: bool | None = None
    print("started", flush=True)
    while True:
        now = leadership.check()
        if now != last:
            print("leader" if now else "follower", flush=True)
            last = now
        time.sleep(interval)


if __name__ == "__main__":
    main()
