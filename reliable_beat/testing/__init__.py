"""Helpers for testing applications built on reliable_beat (and reliable_beat itself).

* :mod:`reliable_beat.testing.servers` starts throwaway PostgreSQL and Redis servers from the
  local binaries (works as root: PostgreSQL is started as the ``postgres`` system user).
"""
