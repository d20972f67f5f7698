"""``python -m reliable_beat.cli``: the ``reliable-beat`` command line."""

from __future__ import annotations

from reliable_beat.cli import main

if __name__ == "__main__":
    main()
