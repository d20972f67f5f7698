"""The payouts example: merchants paid on a schedule, exactly once per merchant per slot.

Run ``python -m examples.payouts`` (embedded: SQLite store + SQLite-file broker) or
``python -m examples.payouts --server`` (private PostgreSQL + Redis), ``--break-it`` to
SIGKILL / SIGSTOP beats and workers during the run.
"""
