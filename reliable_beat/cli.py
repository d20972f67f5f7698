"""Standalone ``reliable-beat`` entry point (the same commands as ``celery reliable-beat``)."""

from __future__ import annotations

from reliable_beat.celery.commands import reliable_beat

__all__ = ["main"]


def main() -> None:
    """Run the ``reliable-beat`` command line."""
    reliable_beat(prog_name="reliable-beat")


if __name__ == "__main__":
    main()
