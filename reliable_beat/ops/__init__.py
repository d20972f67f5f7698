"""The operations layer: what an operator does and reads, for every front end.

The command line (:mod:`reliable_beat.cli`), the Django admin
(:mod:`reliable_beat.contrib.django.admin`) and the web dashboard (:mod:`reliable_beat.web`)
call these functions and only render their results; none of them calls another front end.
Framework-neutral, like the core below it: an app is optional and reached through
:mod:`reliable_beat.adapters`.

* :mod:`~reliable_beat.ops.actions`: trigger an entry now, backfill a window.
* :mod:`~reliable_beat.ops.requeue`: requeue a dead letter (run, actor run, dropped
  message, outbox row), with the question to confirm first.
* :mod:`~reliable_beat.ops.describe`: the five questions an operator asks of a job.
* :mod:`~reliable_beat.ops.entries`: runtime entries validated as a beat validates
  beat_schedule entries, the quarantine check behind resume, a schedule in words.
* :mod:`~reliable_beat.ops.context`: the app's settings and zone, resolved once for all.
* :mod:`~reliable_beat.ops.status`: the status of a store (``reliable-beat status``, the
  dashboard's alarms), from the reads of :mod:`~reliable_beat.ops.reads` and the verdicts of
  :mod:`~reliable_beat.ops.checks` (the problems ``status --check`` exits 1 on).
"""
