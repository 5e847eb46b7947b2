"""Shared pytest setup: tests import helpers from tests/helpers."""
import os
import sys

import pytest

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


def pytest_collection_modifyitems(config, items):
    """The longest tests first, each module's tests kept together (its module fixtures set up
    once): xdist hands tests out in this order, and with the longest collected last (the
    benchmark and example scripts' runs, tests/test_benchmark_*.py and test_example*.py, and
    mypy's, a minute from a cold cache) one worker ran them alone at the end while the other
    had nothing left. Those modules first, then the others with multi-process tests (marked
    slow), then the rest."""
    heavy = {item.module.__name__ for item in items
             if item.get_closest_marker("slow") is not None and item.module is not None}

    def rank(item: pytest.Item) -> int:
        name = item.module.__name__ if item.module is not None else ""
        return 0 if name.startswith(("test_benchmark", "test_example", "test_static")) else (
            1 if name in heavy else 2)
    items.sort(key=rank)
