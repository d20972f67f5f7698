"""The project's own test harness; not shipped in the wheel, not for applications.

* :mod:`harness.servers` starts throwaway PostgreSQL (trust auth) and Redis (protected mode off)
  servers from the local binaries, on loopback, for the test suite, the benchmarks and the
  examples' ``--store postgres`` mode. Never for production: that is why it lives here and not
  in the ``reliable_beat`` package.
* :mod:`harness.faults` is the long fault-injection run (``make faults``), and
  :mod:`harness.faultapp` the Celery app its processes run.
"""
