"""Profiling: records host calls and stage spans, writes the report directory, compares runs."""

from pipetorch.profiling.channel import Channel

__all__ = ["Channel"]
