"""Make `import poptorch` / `import popdist` (and their submodules) resolve to pipetorch's."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["ALIAS", "ALIASES", "TARGET", "install_poptorch_alias", "poptorch_alias_path"]

ALIAS = "poptorch"
TARGET = "pipetorch"
# Graphcore's top-level packages and the pipetorch modules standing in for them. Only
# `pipetorch run` installs them: nothing named `popdist` is installed, so a real one is not
# shadowed elsewhere.
ALIASES = {ALIAS: TARGET, "popdist": "pipetorch.popdist"}


def _target_name(fullname: str) -> str | None:
    """`poptorch.optim` -> `pipetorch.optim`; None for names outside the aliases."""
    for alias, target in ALIASES.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return target + fullname[len(alias):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands the already imported pipetorch module to the import system unchanged."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        # module_from_spec() always stamps the alias spec on the module; the real module must
        # keep its own, or reloads and pickling by module path would see "poptorch".
        module.__spec__ = self._spec


class PoptorchAliasFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder answering `poptorch[.x]` with the module `pipetorch[.x]` (and
    `popdist[.x]` with `pipetorch.popdist[.x]`)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        real_name = _target_name(fullname)
        if real_name is None:
            return None
        try:
            module = importlib.import_module(real_name)
        except ModuleNotFoundError as exc:
            if exc.name != real_name:
                raise  # a dependency of an existing pipetorch module is missing: show that
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: pipetorch has no {real_name!r} to stand in "
                f"for it (PopTorch scripts run on pipetorch through `import poptorch` -> "
                f"`import pipetorch` and `import popdist` -> `import pipetorch.popdist`); "
                f"remove the import or use a pipetorch equivalent",
                name=fullname) from None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__"))


def install_poptorch_alias() -> None:
    """Put the alias finder first on `sys.meta_path` (idempotent)."""
    if not any(isinstance(f, PoptorchAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PoptorchAliasFinder())


def poptorch_alias_path() -> str:
    """The folder holding the `poptorch` and `popdist` shims that install the aliases in a
    fresh interpreter.

    Child interpreters (spawned workers re-importing a script, `subprocess` calls to python)
    do not inherit `sys.meta_path`; with this folder on PYTHONPATH their `import poptorch`
    finds the shim, which installs the alias and replaces itself by pipetorch.
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")
