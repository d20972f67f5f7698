"""Benchmarks of reliable_beat, side by side with stock Celery beat, RedBeat and raw ceilings.

Run ``python -m benchmarks [--size smoke|full] [--only NAME]``; see ``docs/performance.md``.
"""
