"""Compile-time: where each stage runs, what flows between stages, which weights are tied. Runs in the user's process before any worker starts."""
