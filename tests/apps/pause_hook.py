"""``RB_PAUSE_AFTER_CLAIM_AHEAD``: pause a beat right after a claim that took slots ahead.

Imported by the test apps (``beatapp`` for ``celery beat``, ``dq_app`` for ``reliable-beat
dramatiq beat``). When the environment names a file and that file exists, the next claim that
committed triggers claimed ahead (slot still to come) removes it, prints ``beatapp: PAUSED
after claiming ahead <slot> ...`` to stderr and sleeps ``RB_PAUSE_SECONDS`` (default 1) right
after the commit, before the loop holds the triggers: a slow return from the claim (a loaded
host), widened so a test can land a SIGTERM there (tests/acceptance/test_graceful_stop.py).
"""

from __future__ import annotations

import os
import sys
import time


def install() -> None:
    flag = os.environ.get("RB_PAUSE_AFTER_CLAIM_AHEAD")
    if not flag:
        return
    from reliable_beat.beat import Beat

    tick = Beat.tick
    pause = float(os.environ.get("RB_PAUSE_SECONDS", "1") or 1)

    def tick_then_pause(self: Beat) -> object:
        result = tick(self)
        if result.ahead and os.path.exists(flag):
            os.unlink(flag)
            slots = sorted({t.fire_at for t in result.ahead})
            print("beatapp: PAUSED after claiming ahead "
                  + " ".join(s.isoformat() for s in slots), file=sys.stderr, flush=True)
            time.sleep(pause)
        return result

    Beat.tick = tick_then_pause  # type: ignore[method-assign,assignment]


install()
