"""Adapters for frameworks other than the task queue (``reliable_beat.contrib.django``)."""
