"""The installed libraries a model's classes come from, for the zygote to import before it forks
the model's stage workers.

A stage worker unpickling its stage imports the modules its classes live in: a HuggingFace
model's `transformers` costs each worker seconds, and each wrapper's workers again. Imported
once in the zygote, every forked worker finds them there, the first wrapper's and every later
one's. Only installed libraries are imported ahead (files under site-packages): a module of the
user's own (a script's `__main__`, a test file) is imported by the worker as before, and for it
the installed libraries it imported are named instead.
"""
from __future__ import annotations

import site
import sys
import sysconfig
import types
from functools import lru_cache

import torch.nn as nn

__all__: list[str] = []

_ALREADY = ("torch", "pipetorch")  # imported by every zygote when it starts


def libraries(model: nn.Module) -> tuple[str, ...]:
    """The installed modules defining the classes of `model`'s modules (and their bases), and
    those the user's own modules among them imported, in first-seen order."""
    names: dict[str, None] = {}
    seen: set[str] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__ not in seen:
                seen.add(cls.__module__)
                _add(sys.modules.get(cls.__module__), names)
    return tuple(names)


def _add(module: types.ModuleType | None, names: dict[str, None]) -> None:
    if module is None:
        return
    if _installed(module):
        names[module.__name__] = None
        return
    for value in vars(module).values():  # the user's module: the libraries it imported
        if isinstance(value, types.ModuleType) and _installed(value):
            names[value.__name__] = None


def _installed(module: types.ModuleType) -> bool:
    name, path = module.__name__, getattr(module, "__file__", None)
    if path is None or name.partition(".")[0] in _ALREADY:
        return False
    return path.startswith(_site_folders())


@lru_cache(maxsize=1)
def _site_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        folders.add(site.getusersitepackages())
    return tuple(sorted(f.rstrip("/") + "/" for f in folders))
