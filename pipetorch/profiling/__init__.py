"""Profiling: records host calls and stage spans, writes the report directory, compares runs."""

__all__: list[str] = []
