"""Micro-batch schedules as data: per-stage action lists, their per-device merge, checks and
drawing."""
