"""Shared pytest setup: tests import helpers from tests/helpers."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PIPETORCH_DEVICE", "cpu")
# A stage worker that stops answering fails a test in a minute, not after the 10-minute default.
os.environ.setdefault("PIPETORCH_TIMEOUT", "60")
