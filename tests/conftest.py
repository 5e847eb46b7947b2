"""Shared pytest setup: tests import helpers from tests/helpers."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PIPETORCH_DEVICE", "cpu")
# A stage worker that stops answering fails a test in a minute, not after the 10-minute default.
os.environ.setdefault("PIPETORCH_TIMEOUT", "60")


def pytest_addoption(parser, pluginmanager):
    # pyproject's `timeout` belongs to pytest-timeout; where the plugin is absent (the GPU
    # machine's python3, or `-p no:timeout`) declare it here so pytest runs without a warning.
    if not pluginmanager.hasplugin("timeout"):
        parser.addini("timeout", "per-test time limit, enforced only by pytest-timeout")


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): enforced only by pytest-timeout")
