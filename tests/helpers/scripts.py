"""Loading the benchmark and example scripts (not packages) as modules, for tests of their pieces."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARKS = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"


def _load(path: Path, name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `<name>_benchmark`."""
    return _load(BENCHMARKS / f"{name}.py", f"{name}_benchmark")


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as the module `<name>_example` (its main() is not run)."""
    return _load(EXAMPLES / f"{name}.py", f"{name}_example")
