"""Run ``Beat.tick`` in a loop for a while: one framework-neutral beat process.

Usage: ``python tests/apps/tickloop.py URL SECONDS OWNER`` (repo root on PYTHONPATH).
Prints one JSON line with its counts at the end. Used by the integration tests to run
several beats in separate processes against one store.
"""

from __future__ import annotations

import json
import sys
import time

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store


def main() -> None:
    url, seconds, owner = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    store = Store.from_url(url, role="beat")
    beat = Beat(store, owner=owner, batch_size=int(sys.argv[4]) if len(sys.argv) > 4 else 500)
    deadline = time.monotonic() + seconds
    fired = ticks = duplicates = claimed = 0
    while time.monotonic() < deadline:
        result = beat.tick()
        ticks += 1
        fired += len(result.triggers)
        duplicates += result.duplicates
        claimed += result.claimed
        if not result.claimed:
            time.sleep(0.02)
    store.dispose()
    print(json.dumps({"owner": owner, "ticks": ticks, "fired": fired,
                      "duplicates": duplicates, "claimed": claimed}), flush=True)


if __name__ == "__main__":
    main()
